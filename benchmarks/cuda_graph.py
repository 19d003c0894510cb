"""CUDA-graph capture for the microbenchmarks: time a call's GPU work without the host's."""
from __future__ import annotations

import torch


def capture(fn) -> torch.cuda.CUDAGraph:
    """``fn`` captured in a CUDA graph, after three warm-up calls on a side stream (compilation, autotuning
    and the allocator's first requests stay outside the capture). Replaying the graph runs the same kernels
    on the same buffers with no Python, autograd or launch overhead."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph

"""Subcommands of the ``fastbert`` CLI, one module each (see fastbert/cli.py), and the flags they share."""


def add_kernels_argument(parser) -> None:
    """``--kernels auto|torch|triton``: the same choices as the pretraining config's ``model.kernels``;
    unset or ``auto`` is resolved against the device by ``fastbert.ops.resolve_kernels``."""
    parser.add_argument("--kernels", choices=("auto", "torch", "triton"), default=None,
                        help="kernel path (default auto: triton on CUDA, torch otherwise)")

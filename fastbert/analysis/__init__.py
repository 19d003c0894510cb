"""Looking inside a trained encoder: hidden-state features (``features``), attention maps and
per-head statistics (``attention``), k-means over sentence embeddings (``clustering``), and the
checkpoint / input loading the ``fastbert features | attention | cluster`` commands share
(``loading``)."""

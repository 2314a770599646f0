"""Module-level functions `collective_rpc`/`apply_model` send to a worker group's
ranks by name (each follower imports this module: tests/ must be on its PYTHONPATH)."""


def rank_and_layers(worker, extra):
    """The rank, how many layers its model holds, and an argument echoed back."""
    return [worker.rank, len(worker.get_model().model.layers), extra]


def qkv_rows(model):
    """Rows of this rank's share of layer 0's fused QKV projection (TP splits them)."""
    return model.model.layers[0].self_attn.qkv_proj.weight.shape[0]

"""Tied weights across pipeline stages: one matrix held by the first and the last layer (tied embeddings).

A causal LM with ``tie_word_embeddings`` shares its token embedding with its LM head: the first and the last
pipeline unit hold one ``Parameter``.  Split over two stages, each stage holds a copy, as DeepSpeed's
``TiedLayerSpec`` does: the copies start equal (broadcast from the first stage's), and after each backward the
copies' gradients are summed between the ranks holding one, so every copy takes the same update.

``tied_parameters(layers)`` finds the shared parameters, as ``(layer, name in the layer)`` pairs;
``tied_layout`` puts them in ``PlanRunner``'s layout, ``check_tied_layout`` refusing a tp > 1 stage holding a copy.
On DeepSpeed's
own grid ``tied_comms`` builds the groups of DeepSpeed's tied-weight mechanism (one per replica: its first and
last stage), which ``HeteroPipelineModule`` gives its engine (``ReduceTiedGrads``, before the data-parallel
reduction); per-replica plans reduce the matrix as one holder set spanning both stages (``ReplicaLayout.tied``).
"""

from __future__ import annotations

from typing import Any, Sequence

__all__ = ["tied_parameters", "tied_layout", "tied_comms", "check_tied_layout"]


def tied_parameters(layers: Sequence[Any]) -> tuple[tuple[int, str], ...]:
    """The parameters the first and the last layer share, as ``(layer, name)`` pairs (the first layer's first);
    ``()`` when they share none, or either is not a built module (a ``LayerSpec``)."""
    import torch

    if len(layers) < 2 or not all(isinstance(m, torch.nn.Module) for m in (layers[0], layers[-1])):
        return ()
    first = {id(q): n for n, q in layers[0].named_parameters() if q.requires_grad}
    last = {id(q): n for n, q in layers[-1].named_parameters() if q.requires_grad}
    shared = [k for k in first if k in last]
    out = [(0, first[k]) for k in shared] + [(len(layers) - 1, last[k]) for k in shared]
    return tuple(out)


def tied_layout(layout: Any, layers: Sequence[Any]) -> Any:
    """``layout`` (a ``ReplicaLayout``) with the parameters ``layers`` tie (``tied_parameters``), checked by
    ``check_tied_layout``; ``layout`` itself when they tie none."""
    from dataclasses import replace

    tied = tied_parameters(layers)
    if not tied:
        return layout
    out = replace(layout, tied=tied)
    check_tied_layout(out)
    return out


def tied_comms(module: Any, tied: tuple[tuple[int, str], ...]) -> list[dict[str, Any]]:
    """On DeepSpeed's grid: for each replica (data-parallel index), one group of its first and last stage; this
    rank's entries ``{"ranks", "group", "params"}`` for the groups it is in (its copies of the tied parameters).

    Collective over the world (``new_group``), in one order on every rank; empty when the first and last layer
    are on one stage (the parameter is then held once)."""
    import deepspeed.comm as dist

    last = module._num_layers - 1
    if not tied or module.stage_owner(0) == module.stage_owner(last):
        return []
    stages = (module.stage_owner(0), module.stage_owner(last))
    out = []
    for dp in range(module._grid.data_parallel_size):
        ranks = [module._grid.stage_to_global(stage_id=s, data=dp) for s in stages]
        group = dist.new_group(ranks=ranks)
        if module.global_rank in ranks:
            layer = 0 if module.global_rank == ranks[0] else last
            params = [module.forward_funcs[layer - module._local_start].get_parameter(name)
                      for lay, name in tied if lay == layer]
            out.append({"ranks": ranks, "group": group, "params": params})
    return out


def check_tied_layout(layout: Any) -> None:
    """Refuse a plan splitting its tied matrix (``layout.tied``, a ``ReplicaLayout``) over stages where a stage
    holding the first or the last layer is tensor-parallel (a tp head splits the matrix by vocabulary rows, the
    embedding keeps it whole)."""
    from het_strategy.core.errors import field_error

    last = layout.num_layers - 1
    if not layout.tied or all(layout.layers_of(r) == (0, last + 1) for r in layout.tied_holders):
        return
    for p, groups in enumerate(layout.stage_groups):
        for s, group in enumerate(groups):
            start, stop = layout.parts[p][s], layout.parts[p][s + 1]
            if len(group) > 1 and (start == 0 or stop == last + 1):
                raise field_error(f"plan.pipelines[{p}].stages[{s}].tp", len(group), "be 1 on a stage holding the "
                                  f"tied embedding (layer 0) or head (layer {last}) when the plan puts them on "
                                  "different stages", "re-plan with tp 1 there, or untie the embeddings")

"""The computations on parameters of one pass run again as one graph (:func:`stitch`), so that the per-example
gradients of their uses are carried back to the parameters by one batched vector-Jacobian product, not one for
each computation (a weight built by thirty small steps, HRA's product of Householder reflections
W = Π_k (I − 2 u_k u_kᵀ), took thirty pull-backs, each with its own per-example gradients formed in between).

Each computation is run again in the order it ran, with each operand that is a parameter (or a view of one) replaced
by a detached copy requiring gradient (its *leaf*, one for each operand of each computation, as
:class:`.rerun.LocalRun` makes them), and each operand that is an earlier computation's output (or a view of it)
replaced by that computation's output from this run, viewed as the operand was (:func:`_view_of`). Where o_m are the
outputs with uses and g_{m,i} their per-example gradients, the chain rule through the graph gives each leaf s

    ∇_s ℓ_i = Σ_m (∂o_m/∂s)ᵀ g_{m,i},

the same sum the computation-by-computation pull-back forms (:func:`.derived.pull_back`, each computation's local
Jacobian in turn), each leaf's share of a parameter then added up in the parameter's coordinates as there.

It is taken only where that graph is the recorded one: no operand of any computation has been written in place since
it ran (version counters, :meth:`.rerun.LocalRun.unwritten`; an earlier computation's output is not read, its run
stands in), every computation runs again, and every output of the run equals what the computation gave (its recorded
output, or where that was written since, as OFT's ``R.add_(Q_power)`` writes its sum, the computation's own run
again, made before the write: :meth:`.rerun.LocalRun.as_recorded`), strided (no sparse weight's Jacobian is formed).
Otherwise (None), the computations are pulled back one by one, each checked by its own :class:`.rerun.LocalRun`."""

from __future__ import annotations

from dataclasses import dataclass
import torch

from dpml.train.exact_path import batched_vjps
from dpml.train.rules.derived import Derived
from dpml.train.rules.flat_indices import offsets_are_values
from dpml.train.rules.registry import Tracked

SourceKey = tuple[int, int]
"""(k, j): the j-th source of the k-th computation of the chain (later ones first), as :mod:`.derived` keys them."""


@dataclass(eq=False)
class Stitched:
    """The computations of a chain run again as one graph: each computation's output from the run, by the id of its
    recorded output (``outputs``), and the leaves the run started from, each with its source's key and
    :class:`Tracked` view (``leaves``)."""

    outputs: dict[int, torch.Tensor]
    leaves: list[tuple[SourceKey, Tracked, torch.Tensor]]

    def pull_back(self, gradients: dict[int, torch.Tensor]) -> list[tuple[SourceKey, Tracked, torch.Tensor]]:
        """Each leaf's per-example gradients, (B, *leaf.shape), from the per-example gradients of the outputs with
        uses (``gradients``: by the id of the recorded output, (B, *output.shape)), all in one batched backward
        pass."""
        reached = [(self.outputs[key], g) for key, g in gradients.items() if self.outputs[key].requires_grad]
        if not reached:
            batch = next(iter(gradients.values())).shape[0]
            return [(key, tracked, leaf.new_zeros((batch, *leaf.shape))) for key, tracked, leaf in self.leaves]
        found = _vmapped_vjps(
            [o for o, _ in reached], [leaf for *_, leaf in self.leaves], [g.to(o.dtype) for o, g in reached]
        )
        return [(key, tracked, g) for (key, tracked, _), g in zip(self.leaves, found, strict=True)]


def _vmapped_vjps(
    outputs: list[torch.Tensor], inputs: list[torch.Tensor], cotangents: list[torch.Tensor]
) -> list[torch.Tensor]:
    """Σ_o (∂o/∂x)ᵀ c_{o,b} for each row b of the cotangents and each input x, (B, *x.shape): ``torch.func.vmap`` over
    one backward pass, whose batching rules carry a view's backward (``as_strided``, an index) as one operation for
    all rows, where autograd's own batched pass (:func:`dpml.train.exact_path.batched_vjps`, the fallback) loops over
    the rows for them."""

    def one(*rows: torch.Tensor) -> tuple[torch.Tensor, ...]:
        found = torch.autograd.grad(outputs, inputs, rows, retain_graph=True, allow_unused=True)
        return tuple(torch.zeros_like(x) if g is None else g for x, g in zip(inputs, found, strict=True))

    try:
        return list(torch.func.vmap(one)(*cotangents))
    except (RuntimeError, ValueError, TypeError, NotImplementedError):  # (a backward torch.func cannot batch)
        return batched_vjps(outputs, inputs, cotangents)


def stitch(chain: list[Derived]) -> Stitched | None:
    """The computations ``chain`` (later ones first, as :func:`.pull_backs.pull_back_all` orders them) run again as one
    graph, or None where that graph could differ from the recorded one (the module's docstring). The run checks
    itself against the recorded outputs, so no computation needs its own run again (:class:`.rerun.LocalRun`)."""
    order = list(reversed(chain))
    position = {id(node): k for k, node in enumerate(chain)}
    outputs: dict[int, torch.Tensor] = {}
    leaves: list[tuple[SourceKey, Tracked, torch.Tensor]] = []
    checks: list[tuple[torch.Tensor, torch.Tensor]] = []
    calls: dict[int, list[Derived]] = {}  # each call's outputs in the chain, the calls in the order they ran
    for node in order:
        calls.setdefault(id(node.again), []).append(node)
    for outputs_of_call in calls.values():
        node = outputs_of_call[0]
        swapped, stitched = {}, set()  # (stitched: the operands that are earlier outputs, whatever was written since)
        for j, (t, tracked) in enumerate(node.sources):
            earlier = outputs.get(id(tracked.param))
            if earlier is None:
                leaf = t.detach().requires_grad_(True)
                leaves.append(((position[id(node)], j), tracked, leaf))
                swapped[id(t)] = (t, leaf)
            else:
                swapped[id(t)] = (t, _view_of(earlier, tracked))
                stitched.add(id(t))
        recorded = node.again.as_recorded()
        if recorded is None or not node.again.unwritten(besides=stitched):
            return None
        try:
            found = node.again.run_on(swapped)
        except (RuntimeError, TypeError, ValueError, IndexError):
            return None
        if len(found) != len(recorded):
            return None
        checks.extend(zip(found, recorded, strict=True))
        outputs.update({id(n.output): found[n.position] for n in outputs_of_call})
    if not _same_numbers(checks):
        return None
    return Stitched(outputs, leaves)


def _view_of(output: torch.Tensor, tracked: Tracked) -> torch.Tensor:
    """The view ``tracked`` describes (V.flatten()[j] = output.flatten()[index.flatten()[j]]) taken of ``output``:
    the output itself, a strided view laid out as the index is where the index's values are its offsets (the
    operand's own layout, so that the call runs on the same layout again), else the entries gathered."""
    if tracked.index is None:
        return output
    index = tracked.index
    if offsets_are_values(index):
        laid = output.contiguous()
        return laid.as_strided(index.shape, index.stride(), laid.storage_offset() + index.storage_offset())
    return output.reshape(-1)[index]


def _same_numbers(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> bool:
    """Each pair holds the same numbers (shapes and dtypes too, both strided; a NaN differs from itself, as in
    ``torch.equal``), told with one wait for the device."""
    if any(
        (a.shape, a.dtype, a.layout, b.layout) != (b.shape, b.dtype, torch.strided, torch.strided) for a, b in pairs
    ):
        return False
    if all(a.device.type == "cpu" for a, _ in pairs):  # (no device to wait for: compared where they are)
        return all(torch.equal(a.detach(), b.detach()) for a, b in pairs)
    differs = [torch.ne(a.detach(), b.detach()).any() for a, b in pairs if a.numel()]
    return not differs or not bool(torch.stack(differs).any())

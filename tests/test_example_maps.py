"""Where each example's rows are (dpml.train.rules.example_maps): rows moved along the batch dimension by the data
(``index_select``, ``gather``, ``take_along_dim``, ``flip``, ``roll``; token ids moved before their lookup) keep
their examples, and a layer fed moved rows is not taken for batch-first — its clipped sum and norms equal the float64
per-example loop's. Attributing a layer's rows to the wrong examples would let one example's gradient be clipped by
another's norm, and its contribution exceed C."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from test_op_rules import assert_clipped_like_the_loop, assert_exact_without_the_exact_path
from torch import nn

from dpml.train.clipping import engine_pass
from dpml.train.clipping_check import plan_clipping
from dpml.train.dpsgd import per_example_cross_entropy

MOVES = ["index_select", "gather", "take_along_dim", "flip", "roll", "ids"]


class Moved(nn.Module):
    """Two layers with the batch's rows put in another order between them (by the data: the order of the first
    feature), and back in the batch's order before the loss."""

    def __init__(self, move: str) -> None:
        super().__init__()
        self.move = move
        self.emb = nn.Embedding(11, 4)
        self.a, self.b = nn.Linear(4, 6), nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids, features = x[:, 0].long(), x[:, 1:]
        order = features[:, 0].argsort()
        back = order.argsort()
        if self.move == "ids":  # the ids moved before their lookup, the lookup's rows moved back
            h = torch.tanh(self.a(self.emb(ids.index_select(0, order)) + features.index_select(0, order)))
            return self.b(h).index_select(0, back)
        h = torch.tanh(self.a(self.emb(ids) + features))
        if self.move == "index_select":
            moved, restore = h.index_select(0, order), back
        elif self.move == "gather":
            moved, restore = torch.gather(h, 0, order[:, None].expand(-1, h.shape[1])), back
        elif self.move == "take_along_dim":
            moved, restore = torch.take_along_dim(h, order[:, None], 0), back
        elif self.move == "flip":
            moved, restore = h.flip(0), torch.arange(h.shape[0] - 1, -1, -1)
        else:
            moved, restore = torch.roll(h, 2, 0), (torch.arange(h.shape[0]) + 2) % h.shape[0]
        return self.b(moved).index_select(0, restore)


def batch(size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 11, (size, 1), generator=g).double()
    return torch.cat([ids, torch.randn(size, 4, generator=g, dtype=torch.float64)], 1), torch.randint(0, 3, (size,))


@pytest.mark.parametrize("move", MOVES)
def test_rows_moved_along_the_batch_keep_their_examples(move: str) -> None:
    torch.manual_seed(0)
    model = Moved(move).double()
    x, y = batch(7, 1)
    found = engine_pass(model, per_example_cross_entropy, x, y)
    expected: set[str] = set()
    assert set(found.exact) == expected, found.reasons
    assert_clipped_like_the_loop(model, x, y)  # the engine alone, no plan: its maps, not the probe's check
    plan = plan_clipping(model, per_example_cross_entropy, tuple(x.shape[1:]), x.dtype, probe=(x, y))
    assert set(plan.exact_parameters) == expected and "b" not in plan.fast_layers, plan.lines()  # b's rows moved


def test_rows_taken_in_a_sorts_order_are_followed() -> None:
    """Rows indexed by the order a sort along the batch gives (``h[order]``) keep their examples, and a sort's values
    along the batch beside them (unused here but for a zero) take no layer off its rule: nothing goes exact."""

    class SortedRows(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(4, 6), nn.Linear(6, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = torch.tanh(self.a(x))
            key = h[:, 0]
            _, order = torch.sort(key, 0)
            return self.b(h[order])[order.argsort()] + 0 * torch.sort(h, 0).values.sum()

    torch.manual_seed(0)
    model = SortedRows().double()
    x = torch.randn(6, 4, dtype=torch.float64)
    found = engine_pass(model, per_example_cross_entropy, x, torch.randint(0, 3, (6,)))
    assert found.exact == {}, found.reasons  # h[order]: an index with a map of its own rows; the sort's values unused


class Windows(nn.Module):
    """Each example's 4×4 grid of tokens split into four 2×2 windows, stacked along the first dimension example by
    example ((B·4, 4, …): Swin's layout, ``"runs"``), window by window ((4·B, 4, …): ``"interleaved"``) or as the
    batch's windows then the same windows in reverse batch order (``"joined"``: 8 rows per example, not in runs);
    token ids looked up, a LayerNorm and a Linear on the windows, merged back per example before the head."""

    def __init__(self, layout: str) -> None:
        super().__init__()
        self.layout = layout
        self.emb = nn.Embedding(7, 6)
        self.norm = nn.LayerNorm(6)
        self.proj = nn.Linear(6, 6)
        self.head = nn.Linear(6, 3)

    def windows(self, grid: torch.Tensor) -> torch.Tensor:
        """(B, 4, 4) -> the layout's windows, (rows, 4)."""
        batch = grid.shape[0]
        cut = grid.reshape(batch, 2, 2, 2, 2)
        if self.layout == "interleaved":
            return cut.permute(1, 3, 0, 2, 4).reshape(-1, 4)
        runs = cut.permute(0, 1, 3, 2, 4).reshape(-1, 4)
        return torch.cat([runs, runs.reshape(batch, 4, 4).flip(0).reshape(-1, 4)]) if self.layout == "joined" else runs

    def per_example(self, h: torch.Tensor, batch: int) -> torch.Tensor:
        """The windows' rows back to (B, windows·4, C)."""
        if self.layout == "interleaved":
            return h.reshape(4, batch, 4, -1).transpose(0, 1).reshape(batch, 16, -1)
        if self.layout == "joined":
            first, second = h.chunk(2)
            return torch.cat([first.reshape(batch, 16, -1), second.reshape(batch, 16, -1).flip(0)], 1)
        return h.reshape(batch, 16, -1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, grid = x.shape[0], x.reshape(-1, 4, 4)
        ids = (grid.abs() * 3).long() % 7
        h = self.emb(self.windows(ids)) * torch.tanh(self.windows(grid))[..., None]  # (rows, 4, 6)
        h = self.proj(torch.tanh(self.norm(h)))
        return self.head(torch.tanh(self.per_example(h, batch)).mean(1))


@pytest.mark.parametrize("layout", ["runs", "interleaved", "joined"])
def test_layers_on_each_examples_run_of_windows_take_their_shortcut(layout: str) -> None:
    """A Linear, a LayerNorm and an Embedding called on windows (B·k, …) holding each example's k slices in one run
    take their layers' shortcut, as on (B, k, …): the Swin layout. Windows in any other order (interleaved across the
    batch, or an example's windows in two places) are the rules' (the shortcut would clip one example's positions with
    another's): either way the clipped sums and norms are the float64 per-example loop's."""
    torch.manual_seed(0)
    model = Windows(layout).double()
    x = torch.randn(6, 16, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    y = torch.randint(0, 3, (6,))
    found = engine_pass(model, per_example_cross_entropy, x, y)
    assert found.exact == {}, found.reasons
    assert_clipped_like_the_loop(model, x, y)  # the engine alone, no plan: its maps, not the probe's check
    plan = plan_clipping(model, per_example_cross_entropy, tuple(x.shape[1:]), x.dtype, probe=(x, y))
    assert plan.exact_parameters == (), plan.lines()
    windowed = {"emb", "norm", "proj"}
    if layout == "runs":
        assert windowed <= set(plan.fast_layers) and not plan.rule_parameters, plan.lines()
    else:
        assert not windowed & set(plan.fast_layers), plan.lines()
        assert {n.split(".")[0] for n in plan.rule_parameters} == windowed, plan.lines()


class TimeMajorAttention(nn.Module):
    """Relative attention written as XLNet writes it, time-major and in index equations: the tokens' rows (T, B, h)
    (moved by an einsum of no parameter, ``bth->tbh``), per-head projections ``ibh,hnd->ibnd``, a per-head bias added
    to the queries (T, B, H, d) + (H, d), scores ``ibnd,jbnd->bnij`` (the batch moved first), the values back
    time-major ``bnij,jbnd->ibnd``, the output projection ``ibnd,hnd->ibh``, then a linear layer on the time-major
    rows."""

    def __init__(self, width: int = 6, heads: int = 2, head: int = 3) -> None:
        super().__init__()
        self.table = nn.Embedding(11, width)
        self.q, self.k, self.v, self.o = (nn.Parameter(torch.randn(width, heads, head) * 0.4) for _ in range(4))
        self.bias = nn.Parameter(torch.randn(heads, head) * 0.4)
        self.inner = nn.Linear(width, width)
        self.out = nn.Linear(width, 3)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # (B, T)
        rows = torch.einsum("bth->tbh", self.table(ids))
        q = torch.einsum("ibh,hnd->ibnd", rows, self.q) + self.bias
        k, v = torch.einsum("ibh,hnd->ibnd", rows, self.k), torch.einsum("ibh,hnd->ibnd", rows, self.v)
        scores = torch.einsum("ibnd,jbnd->bnij", q, k).softmax(-1)
        attended = torch.einsum("ibnd,hnd->ibh", torch.einsum("bnij,jbnd->ibnd", scores, v), self.o)
        return self.out(torch.tanh(self.inner(attended + rows)).mean(0))


@pytest.mark.parametrize("length", [6, 5])
def test_time_major_index_equations_take_the_rules_with_the_batch_where_it_is(length: int) -> None:
    """Batch 5: at 5 tokens the time-major rows' first dimension is B too, and an einsum that moved the batch must
    not be taken for batch-first (the linear layer would clip each token's rows as an example's)."""
    torch.manual_seed(7)
    model = TimeMajorAttention()
    x = torch.randint(0, 11, (5, length), generator=torch.Generator().manual_seed(3))
    y = torch.randint(0, 3, (5,), generator=torch.Generator().manual_seed(4))
    found = engine_pass(model.double(), per_example_cross_entropy, x, y)
    assert found.exact == {}, found.reasons
    assert_clipped_like_the_loop(model, x, y)


class NumpyNames(nn.Module):
    """A learned prefix joined before each example's positions, a tensor built from the batch's but of shape
    (T + 2, T + 2) joined along its second dimension (Funnel Transformer's class mask), a mean kept as a dimension and
    a sort along the positions, with their dimensions named as NumPy names them (``axis``, ``keepdims``) — which
    torch's parser takes for its own ``dim`` and ``keepdim`` — or as torch does."""

    def __init__(self, numpy: bool) -> None:
        super().__init__()
        self.numpy = numpy
        self.prefix = nn.Parameter(torch.randn(1, 2, 4))
        self.mix, self.out = nn.Linear(4, 4), nn.Linear(4, 3)

    def along(self, dim: int, keep: bool = False) -> dict[str, object]:
        names = ("axis", "keepdims") if self.numpy else ("dim", "keepdim")
        return {names[0]: dim} | ({names[1]: True} if keep else {})

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, 4)
        h = torch.tanh(self.mix(torch.cat([self.prefix.expand(x.shape[0], -1, -1), x], **self.along(1))))
        mask = h.new_ones(h.shape[1], h.shape[1])  # (T + 2, T + 2), from the batch's tensor
        mask = torch.concat([mask[:, :1], mask], **self.along(1))[:, 1:]
        h = h + 0.1 * torch.einsum("st,btd->bsd", mask, h)
        h = h - h.mean(**self.along(1, keep=True))
        return self.out(torch.sort(h, **self.along(1)).values.sum(**self.along(1)))


@pytest.mark.parametrize("numpy", [False, True], ids=["torch-names", "numpy-names"])
def test_dimensions_named_as_numpy_names_them_are_followed_as_torch_s(numpy: bool) -> None:
    """With T + 2 = B, a join of the (T + 2, T + 2) tensor read as along the first dimension (``dim``'s default)
    would be a join of the batch; the prefix joined along ``axis=1`` as one along the batch went to the exact path."""
    torch.manual_seed(0)
    x = torch.randn(6, 4, 4, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    y = torch.randint(0, 3, (6,), generator=torch.Generator().manual_seed(2))
    assert_exact_without_the_exact_path(NumpyNames(numpy), per_example_cross_entropy, x, y)


class GlobalTokens(nn.Module):
    """Longformer's global attention, written out: each example's global positions (a count that differs from one
    example to another: positions 0 and, where its first feature is positive, 2) gathered by index into a tensor of
    zeros made for them, time-major (G, B, d), with ``new_zeros``, ``zeros_like`` or ``torch.zeros`` and
    ``t[key] = value``; their queries projected there (``F.linear`` on a parameter: the rule must know each row's
    example) and scored against the keys of their own example, which weigh its positions."""

    def __init__(self, made: str) -> None:
        super().__init__()
        self.made = made
        self.embed = nn.Linear(4, 6)
        self.query = nn.Parameter(torch.randn(6, 6) * 0.4)
        self.key = nn.Linear(6, 6)
        self.out = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, 4)
        h = torch.tanh(self.embed(x)).transpose(0, 1)  # (T, B, d), time-major as Longformer's
        chosen = torch.zeros(x.shape[:2], dtype=torch.bool)
        chosen[:, 0] = True
        chosen[:, 2] = x[:, 0, 0] > 0
        count = chosen.sum(1)
        rows, where = chosen.nonzero(as_tuple=True)  # (example, position) of each global token
        slot = torch.cat([torch.arange(int(c)) for c in count])  # its place among its example's
        if self.made == "new_zeros":
            tokens = h.new_zeros(int(count.max()), x.shape[0], h.shape[2])
        elif self.made == "zeros":
            tokens = torch.zeros(int(count.max()), x.shape[0], h.shape[2], dtype=h.dtype)
        else:
            tokens = torch.zeros_like(h[: int(count.max())])
        tokens[slot, rows] = h[where, rows]
        queries = F.linear(tokens, self.query)  # (G, B, d)
        keys = self.key(h)  # (T, B, d)
        scores = torch.einsum("gbd,tbd->btg", queries, keys).amax(2, keepdim=True)  # (B, T, 1)
        return self.out((torch.softmax(scores, 1) * h.transpose(0, 1)).sum(1))


@pytest.mark.parametrize("made", ["new_zeros", "zeros_like", "zeros"])
def test_rows_written_into_zeros_made_for_them_keep_their_examples(made: str) -> None:
    torch.manual_seed(0)
    x = torch.randn(6, 5, 4, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    assert (x[:, 0, 0] > 0).any() and (x[:, 0, 0] <= 0).any()  # examples with one global token and with two
    y = torch.randint(0, 3, (6,), generator=torch.Generator().manual_seed(4))
    assert_exact_without_the_exact_path(GlobalTokens(made), per_example_cross_entropy, x, y)


class WrittenRows(nn.Module):
    """Each example's first two positions, time-major (T = 3, B, d), written into zeros made for them (2, B, d), whose
    map ``new_zeros`` cannot give (neither h's shape nor a broadcast of it); then ``F.linear`` with a parameter on
    them and the rows read back in the batch's order. ``how``:

    - ``permuted``: all of them, at the places along the batch a data-dependent order gives (the map follows);
    - ``shifted``: a partial write, example i's first position at place i + 1 (no index along the batch is every
      written place's example: the map is lost, the rule cannot know the rows' examples);
    - ``written-before``: the zeros first written through a view (example 0's second position at (1, 1), read by
      example 0's output alone), then every example's first position at (0, i): taking the rest for untouched zeros
      would give (1, 1) to example 1.

    No example's output reads another's values (what the probe's independence check asks of a model)."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.a = nn.Linear(4, 5)
        self.w = nn.Parameter(torch.randn(5, 5) * 0.4)
        self.out = nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, 3, 4)
        h = torch.tanh(self.a(x)).transpose(0, 1)  # (3, B, 5)
        buf = h.new_zeros(2, *h.shape[1:])
        order = x[:, 0, 0].argsort()
        if self.how == "permuted":
            buf[:, order] = h[:2]
            return self.out(torch.tanh(F.linear(buf, self.w))[:, order].mean(0))
        if self.how == "shifted":
            buf[0, 1:] = h[0, :-1]
            return self.out(torch.tanh(F.linear(buf, self.w))[0].roll(-1, 0) + h[1])
        buf[1, 1:2].copy_(h[1, :1])
        buf[0] = h[0]
        z = torch.tanh(F.linear(buf, self.w))
        first = (torch.arange(x.shape[0]) == 0).to(x.dtype)[:, None]
        return self.out(z[0] + first * z[1, 1] + h.mean(0))


def test_rows_written_in_a_data_dependent_order_keep_their_examples() -> None:
    torch.manual_seed(1)
    x = torch.randn(7, 3, 4, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    y = torch.randint(0, 3, (7,), generator=torch.Generator().manual_seed(6))
    assert_exact_without_the_exact_path(WrittenRows("permuted"), per_example_cross_entropy, x, y)


@pytest.mark.parametrize("how", ["shifted", "written-before"])
def test_written_rows_whose_examples_cannot_be_known_take_the_exact_path_and_stay_exact(how: str) -> None:
    """The recording itself sends the parameter to the exact path (not the probe after it), and the sums stay exact."""
    torch.manual_seed(2)
    model = WrittenRows(how).double()
    x = torch.randn(7, 3, 4, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    y = torch.randint(0, 3, (7,), generator=torch.Generator().manual_seed(8))
    found = engine_pass(model, per_example_cross_entropy, x, y)
    assert "w" in found.exact, found.reasons
    assert_clipped_like_the_loop(model, x, y)


KEYS = ["tensor", "mask", "none", "ellipsis"]


class ChosenRows(nn.Module):
    """Tokens' rows chosen by an indexing key before a layer — ``tensor``: all rows of the flattened batch in an order
    the data gives (``flat[order]``, a mixture of experts' ``hidden_states[token_idx]``), put back after; ``mask``:
    the rows whose first feature is positive (``flat[mask]``), written back into zeros; ``none``: every position but
    the first (``h[None, :, 1:]``); ``ellipsis``: the same through ``...`` (``h[..., 1:, :]``). Each row's map is alike
    along the width, so it is worked out on one column; the layer's rows must keep their examples."""

    def __init__(self, key: str) -> None:
        super().__init__()
        self.key = key
        self.a, self.b, self.out = nn.Linear(4, 6), nn.Linear(6, 5), nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, 4)
        batch, length, _ = x.shape
        h = torch.tanh(self.a(x))
        flat = h.reshape(-1, h.shape[-1])
        if self.key == "tensor":
            order = x.reshape(-1, 4)[:, 1].argsort()
            z = self.b(flat[order])[order.argsort()].view(batch, length, -1)
        elif self.key == "mask":
            mask = x.reshape(-1, 4)[:, 0] > 0
            rows = self.b(flat[mask])
            z = rows.new_zeros(batch * length, rows.shape[1]).index_copy(0, mask.nonzero()[:, 0], rows)
            z = z.view(batch, length, -1)
        elif self.key == "none":
            z = self.b(h[None, :, 1:])[0]
        else:
            z = self.b(h[..., 1:, :])
        return self.out(torch.tanh(z).mean(1))


@pytest.mark.parametrize("key", KEYS)
def test_rows_chosen_by_a_key_keep_their_examples(key: str) -> None:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(6, 5, 4, generator=g, dtype=torch.float64), torch.randint(0, 3, (6,), generator=g)
    assert_exact_without_the_exact_path(ChosenRows(key), per_example_cross_entropy, x, y)


def _factorised(numel: int, g: torch.Generator) -> list[int]:
    """A random shape of ``numel`` places (its prime factors grouped at random)."""
    factors, n, p = [], numel, 2
    while n > 1:
        while n % p == 0:
            factors.append(p)
            n //= p
        p += 1
    shape: list[int] = []
    for f in factors:
        if shape and torch.rand((), generator=g) < 0.5:
            shape[-1] *= f
        else:
            shape.append(f)
    return [s for s in shape if s > 1] or [1]


def _random_map(g: torch.Generator, most_dims: int, widest: int, examples: int) -> tuple[torch.Tensor, list[int], int]:
    """A random example map (its values below ``examples``) of 2 to ``most_dims`` − 1 dimensions of 1 to ``widest`` − 1
    each, varying along one of them (the batch's, first or not) and broadcast along the others: (map, shape, the
    batch's dimension)."""
    dims = int(torch.randint(2, most_dims, (), generator=g))
    shape = [int(s) for s in torch.randint(1, widest, (dims,), generator=g)]
    batch_dim = int(torch.randint(0, dims, (), generator=g))
    view = [shape[k] if k == batch_dim else 1 for k in range(dims)]
    return torch.randint(0, examples, (shape[batch_dim],), generator=g).view(view).expand(shape), shape, batch_dim


def test_maps_reshaped_over_their_leading_dimensions_equal_the_whole_reshape() -> None:
    """dpml.train.rules.operands.reshaped_map: a map broadcast over its last dimensions, reshaped to any shape of the
    same places, equals ``reshape`` of the whole map (300 random maps, batch-first and time-major, and shapes); and
    the time-major map of a head split is formed over its leading dimensions, not copied whole."""
    from dpml.train.rules.operands import reshaped_map

    g = torch.Generator().manual_seed(0)
    formed = 0
    for _ in range(300):
        examples, shape, batch_dim = _random_map(g, 5, 7, 5)
        for _ in range(3):
            target = _factorised(examples.numel(), g)
            found = reshaped_map(examples, target)
            if found is not None:
                formed += 1
                assert torch.equal(found, examples.reshape(target)), (shape, batch_dim, target)
    assert formed > 100, formed
    time_major = torch.arange(6).view(1, 6, 1).expand(16, 6, 32)
    split = reshaped_map(time_major, [16, 12, 16])
    assert split is not None and torch.equal(split, time_major.reshape(16, 12, 16))
    assert split.stride(-1) == 0 and split.untyped_storage().nbytes() <= 16 * 12 * 8  # (T·B·heads numbers)


def test_maps_moved_on_their_values_alone_equal_the_move_of_the_whole_map() -> None:
    """dpml.train.rules.operands.moved_map: ``index_select``, ``flip``, ``roll`` (with ``dims``) and ``gather`` along
    any dimension of a map broadcast over the others, batch-first or not, equal the same move of the whole map (200
    random maps and moves), and along a broadcast dimension form nothing of the map's size."""
    from dpml.train.rules.operands import moved_map

    g = torch.Generator().manual_seed(1)
    for _ in range(200):
        examples, shape, batch_dim = _random_map(g, 5, 6, 4)
        dims = len(shape)
        dim = int(torch.randint(-dims, dims, (), generator=g))
        index = torch.randint(0, shape[dim], (int(torch.randint(1, 7, (), generator=g)),), generator=g)
        shift = int(torch.randint(-3, 4, (), generator=g))
        for func, args in [
            (torch.index_select, (dim, index)),
            (torch.Tensor.index_select, (dim, index)),
            (torch.flip, ([dim],)),
            (torch.roll, (shift, dim)),
            (torch.roll, (shift,)),  # (no dims: the flattened map rolled, the whole map's function)
            (torch.gather, (dim, _gather_index(g, shape, dim))),
            (torch.Tensor.gather, (dim, _gather_index(g, shape, dim))),
        ]:
            whole = func(examples, *args)
            (found,) = moved_map(func, examples, (examples, *args), {}, whole)
            assert torch.equal(found, whole), (func, shape, batch_dim, args)
    relative = torch.arange(3).view(3, 1, 1, 1).expand(3, 2, 8, 15)  # (B, H, T, 2T−1): XLNet's relative shift
    (shifted,) = moved_map(torch.index_select, relative, (relative, 3, torch.arange(8)), {}, torch.empty(3, 2, 8, 8))
    assert torch.equal(shifted, relative[..., :8]) and shifted.untyped_storage().nbytes() <= 3 * 8
    scores = torch.arange(6).view(6, 1, 1).expand(6, 8, 16)  # (B·H, T, 2k): DeBERTa's c2p scores, gathered
    positions = torch.randint(0, 16, (6, 8, 8), generator=g)
    (gathered,) = moved_map(torch.gather, scores, (scores, -1, positions), {}, torch.empty(6, 8, 8))
    assert torch.equal(gathered, torch.gather(scores, -1, positions)) and gathered.untyped_storage().nbytes() <= 6 * 8


def _gather_index(g: torch.Generator, shape: tuple[int, ...], dim: int) -> torch.Tensor:
    """A ``gather`` index for a tensor of ``shape`` along ``dim``: as many dimensions, each no longer than the
    tensor's (other than ``dim``'s, of any length), its values anywhere along ``dim``."""
    sizes = [
        int(torch.randint(1, 6, (), generator=g))
        if k == dim % len(shape)
        else int(torch.randint(1, n + 1, (), generator=g))
        for k, n in enumerate(shape)
    ]
    return torch.randint(0, shape[dim], sizes, generator=g)


REDUCTIONS = ["mean", "amax", "sum-keepdim", "logsumexp", "std"]


class ReducedOverTime(nn.Module):
    """A time-major activation (T, B, H) whose columns the data puts in another order (``index_select`` along the
    batch's dimension), reduced over time (``mean(0)``, ``amax(0)``, ``sum(0, keepdim=True)``, ``logsumexp(0)``,
    ``std(0)``): each output row is one example's, in that order, through a layer, then put back in the batch's
    order."""

    def __init__(self, reduction: str) -> None:
        super().__init__()
        self.reduction = reduction
        self.a, self.b = nn.Linear(4, 6), nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, 4)
        order = x[:, 0, 0].argsort()
        h = torch.tanh(self.a(x)).transpose(0, 1).index_select(1, order)  # (T, B, 6), columns in the data's order
        if self.reduction == "mean":
            pooled = h.mean(0)
        elif self.reduction == "amax":
            pooled = h.amax(0)
        elif self.reduction == "sum-keepdim":
            pooled = h.sum(0, keepdim=True)[0]
        elif self.reduction == "logsumexp":
            pooled = torch.logsumexp(h, dim=0)
        else:
            pooled = h.std(0)
        return self.b(pooled).index_select(0, order.argsort())


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_rows_reduced_over_time_keep_their_examples(reduction: str) -> None:
    """The map of a reduction over dimensions along which it is alike is carried (the reduced dimensions dropped): the
    layer after it takes its rows' examples from it, not the batch-first convention (which would be wrong here), and
    nothing takes the exact path."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(5)
    x, y = torch.randn(6, 5, 4, generator=g, dtype=torch.float64), torch.randint(0, 3, (6,), generator=g)
    assert_exact_without_the_exact_path(ReducedOverTime(reduction), per_example_cross_entropy, x, y)


def test_reduced_maps_are_the_examples_each_output_place_reads_or_none_where_they_mix() -> None:
    """dpml.train.rules.operands.reduced_map against the examples read by each output place, worked out one place at
    a time (200 random maps, batch-first or not, and reductions over one or two dimensions, keepdim or not): the map
    where every output place reads one example's places, None where some place reads two."""
    from dpml.train.rules.operands import reduced_map

    g = torch.Generator().manual_seed(2)
    both = {True: 0, False: 0}
    for _ in range(200):
        examples, shape, batch_dim = _random_map(g, 4, 5, 3)
        dims = len(shape)
        if torch.rand((), generator=g) < 0.3:
            examples = examples.contiguous()  # (a map held in full, not broadcast)
        count = int(torch.randint(1, 3, (), generator=g))
        reduced = sorted({int(d) for d in torch.randint(0, dims, (count,), generator=g)})
        keepdim = bool(torch.rand((), generator=g) < 0.5)
        out = torch.zeros(shape).sum(reduced, keepdim=keepdim)
        found = reduced_map(examples, (examples, tuple(reduced)), {}, out)
        width = math.prod(shape[k] for k in reduced)  # (the places each output place reads, as a column)
        moved = examples.movedim(reduced, list(range(len(reduced)))).reshape(width, -1)
        sets = [set(moved[:, k].tolist()) for k in range(moved.shape[1])]
        mixes = any(len(s) > 1 for s in sets)
        both[mixes] += 1
        if mixes:
            assert found is None, (shape, batch_dim, reduced)
        else:
            assert found is not None and found.shape == out.shape, (shape, batch_dim, reduced)
            assert found.reshape(-1).tolist() == [s.pop() for s in sets], (shape, batch_dim, reduced)
    assert min(both.values()) > 30, both


VIEWS = {  # (a batch-first x of shape (B, T, D) = (4, 4, 6): T = B, so a view that moves the batch keeps 4 rows first)
    "view heads": lambda x: x.view(4, 4, 2, 3),
    "transpose 1, 2": lambda x: x.transpose(1, 2),
    "first token": lambda x: x[:, 0],
    "chunk": lambda x: x.chunk(3, -1)[1],
    "slice": lambda x: x[:, 1:, 2:],
    "rows flattened": lambda x: x.reshape(4, 24),
    "expanded": lambda x: x.unsqueeze(1).expand(4, 5, 4, 6),
    "transpose 0, 1": lambda x: x.transpose(0, 1),
    "permuted": lambda x: x.permute(1, 0, 2),
    "each example's first token, through its tokens": lambda x: x.view(16, 6)[::4],
    "tokens first, copied": lambda x: x.transpose(0, 1).reshape(4, 24),
    "unbound": lambda x: x.unbind(1)[2],
    "strided rows": lambda x: x.as_strided((4, 6), (6, 1)),
}
MOVING = {"transpose 0, 1", "permuted", "tokens first, copied", "strided rows"}


@pytest.mark.parametrize("name", list(VIEWS))
def test_a_view_is_read_as_batch_first_only_where_its_rows_are_the_sources_rows(name: str) -> None:
    """:func:`dpml.train.rules.operands.rows_kept` (the example maps' shortcut for views of a batch-first tensor, read
    off the strides) says row i of the view reads row i of the source exactly where the view applied to the source's
    example map gives i along the view's first dimension — never for a view that moves the batch, though its first
    dimension has B entries (T = B here): one example's rows taken for another's would let its gradient be clipped by
    another's norm."""
    from dpml.train.rules.operands import rows_kept

    x = torch.randn(4, 4, 6)
    examples = torch.arange(4.0).view(4, 1, 1).expand(4, 4, 6).clone()  # (laid out as x: the same views apply)
    view, mapped = VIEWS[name](x), VIEWS[name](examples)
    batch_first = mapped.shape[0] == 4 and bool((mapped == torch.arange(4.0).view(-1, *[1] * (mapped.dim() - 1))).all())
    assert rows_kept(x, view) == (name not in MOVING)
    assert rows_kept(x, view) == batch_first  # (the map's own answer)
    interleaved = torch.randn(6, 4, 4).permute(2, 1, 0)  # (4, 4, 6), its examples' numbers interleaved in memory
    assert not rows_kept(interleaved, interleaved[:, 0]) and not rows_kept(interleaved, interleaved.transpose(1, 2))

"""The batched torch fallback for packed rows in recurrent and convolutional layers (``packprep.training.restarts``).

transformers' own torch functions (short causal convolution, chunked gated delta rule, chunked Mamba-2 scan) on
literal random tensors, float32, CPU: the whole packed row in one call (a scan: a call a wave) equals each
sequence run through the same function alone, outputs and gradients; a row whose sequences end on, just
before and just after a chunk boundary, and a sequence of one token; and the same row in rows shorter than
its sequences, which the scans then run in pieces, a call a wave, each piece from the state its previous
piece ended with. And the fallback does not loop over sequences: a model's forward and backward run the
same number of operations for a row of 2 sequences as for a row of 8.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
modeling_bamba = pytest.importorskip("transformers.models.bamba.modeling_bamba")
modeling_qwen3_5 = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5", reason="Qwen3.5 needs transformers 5")

from packprep.training import collate_packed, register_packed_layers, restarts  # noqa: E402

LENGTHS = [30, 7, 64, 15, 63, 1, 100, 129]  # on, before and after chunk boundaries of 16 and 64; one token
CU = torch.tensor([0, *LENGTHS]).cumsum(0)
T = int(CU[-1])
CONV = restarts.unwrap(modeling_bamba.causal_conv1d_fn)
GATED_DELTA = restarts.unwrap(modeling_qwen3_5.torch_chunk_gated_delta_rule)
MAMBA2 = restarts.unwrap(modeling_bamba.mamba2_chunk_scan)


def leaves(*shapes):
    torch.manual_seed(0)
    return [torch.randn(*shape, requires_grad=True) for shape in shapes]


def each_alone(function, tensors, dim: int):
    """``function`` on each sequence of the row (tensors cut along ``dim``), outputs joined."""
    return torch.cat([function(*(x.narrow(dim, a, b - a) for x in tensors))
                      for a, b in zip(CU[:-1].tolist(), CU[1:].tolist())], dim)


def assert_same(packed, alone, inputs, atol=1e-5):
    """Outputs equal, and the gradients of one random projection of them with respect to every input."""
    torch.testing.assert_close(packed, alone, atol=atol, rtol=1e-5)
    weight = torch.randn_like(alone)
    for got, want in zip(torch.autograd.grad((packed * weight).sum(), inputs, retain_graph=True),
                         torch.autograd.grad((alone * weight).sum(), inputs)):
        torch.testing.assert_close(got, want, atol=atol, rtol=1e-5)


def test_convolution_window_starts_at_each_sequence():
    x, weight, bias = leaves((1, 12, T), (12, 4), (12,))
    packed = restarts.causal_conv1d(CONV, x, weight, bias, "silu", CU)
    alone = each_alone(lambda part: CONV(part, weight, bias, activation="silu"), [x], 2)
    assert_same(packed, alone, [x, weight, bias])


ROWS = [restarts.ROW, 32]  # rows longer than every sequence; rows of 2 chunks of 16, most sequences in pieces


def test_short_rows_cut_the_sequences_into_waves():
    """The row of 32 tokens is what the tests below run: 5 waves, sequences of one piece in the later ones."""
    scan = restarts.scan_layout(CU, 16, 32)
    assert len(scan.waves) == 5 and [int((w.carry >= 0).sum()) for w in scan.waves] == [0, 4, 3, 2, 1]
    assert len(restarts.scan_layout(CU, 16).waves) == 1


@pytest.mark.parametrize("row", ROWS)
@pytest.mark.parametrize("chunk", [16, None])
def test_gated_delta_rule_state_restarts_at_each_sequence(monkeypatch, row, chunk):
    monkeypatch.setattr(restarts, "ROW", row)
    query, key, value, a, b = leaves((1, T, 2, 16), (1, T, 2, 16), (1, T, 4, 16), (1, T, 4), (1, T, 4))
    g, beta = -torch.nn.functional.softplus(a), b.sigmoid()  # log-decays <= 0, rates in (0, 1)
    packed, state = restarts.gated_delta_rule(GATED_DELTA, query, key, value, g, beta, CU, chunk_size=chunk or 64,
                                              use_qk_l2norm_in_kernel=True)
    alone = each_alone(lambda q, k, v, g_, b_: GATED_DELTA(q, k, v, g=g_, beta=b_, chunk_size=chunk or 64,
                                                           use_qk_l2norm_in_kernel=True)[0],
                       [query, key, value, g, beta], 1)
    assert state is None
    assert_same(packed, alone, [query, key, value, a, b])


def _as_func_module(function):
    """A stand-in for the ``Func`` module ``kernels`` makes of a module-level function (transformers 5.25)."""
    class Func(torch.nn.Module):
        def forward(self, *args, **kwargs):
            return function(*args, **kwargs)
    return Func()


def _dispatcher(function):
    """A wrapper such as transformers' kernel dispatcher: ``functools.wraps``, and a signature of its own."""
    import functools

    @functools.wraps(function)
    def wrapped(*args, **kwargs):
        return function(*args, **kwargs)
    return wrapped


def _opaque(function):
    def wrapped(*args, **kwargs):  # neither __wrapped__ nor the function's signature
        return function(*args, **kwargs)
    return wrapped


@pytest.mark.parametrize("wrap", [_dispatcher, _as_func_module, lambda f: _as_func_module(_dispatcher(f)),
                                  _opaque], ids=["wraps", "func-module", "func-module-of-wraps", "opaque"])
def test_the_torch_function_is_found_under_any_wrapper(wrap):
    """Whatever transformers puts around its function, the fallback finds it, or calls what it is given with
    the function's default chunk (64): never a KeyError from a signature it cannot read."""
    wrapped = wrap(GATED_DELTA)
    if wrap is not _opaque:
        assert restarts.unwrap(wrapped) is GATED_DELTA
    query, key, value, a, b = leaves((1, T, 2, 16), (1, T, 2, 16), (1, T, 4, 16), (1, T, 4), (1, T, 4))
    g, beta = -torch.nn.functional.softplus(a), b.sigmoid()
    packed, _ = restarts.gated_delta_rule(restarts.unwrap(wrapped), query, key, value, g, beta, CU)
    alone = each_alone(lambda q, k, v, g_, b_: GATED_DELTA(q, k, v, g=g_, beta=b_)[0], [query, key, value, g, beta], 1)
    assert_same(packed, alone, [query, key, value, a, b])


@pytest.mark.parametrize("row", ROWS)
@pytest.mark.parametrize("dt_limit", [(0.0, float("inf")), (0.001, 0.1)])
def test_mamba2_scan_state_restarts_at_each_sequence(monkeypatch, row, dt_limit):
    monkeypatch.setattr(restarts, "ROW", row)
    x, dt, a_log, B, C, D, dt_bias = leaves((1, T, 4, 8), (1, T, 4), (4,), (1, T, 1, 16), (1, T, 1, 16), (4,), (4,))
    A = -a_log.exp()
    named = dict(D=D, dt_bias=dt_bias, dt_softplus=True, dt_limit=dt_limit)
    packed = restarts.mamba2_scan(MAMBA2, x, dt, A, B, C, 16, CU, **named)
    alone = each_alone(lambda x_, dt_, B_, C_: MAMBA2(x_, dt_, A, B_, C_, 16, **named), [x, dt, B, C], 1)
    assert_same(packed, alone, [x, dt, a_log, B, C, D, dt_bias], atol=2e-5)


def test_without_the_restarts_the_sequences_would_mix():
    """The literal rows above do carry state across boundaries when run as one sequence (the tests can fail)."""
    query, key, value, a, b = leaves((1, T, 2, 16), (1, T, 2, 16), (1, T, 4, 16), (1, T, 4), (1, T, 4))
    g, beta = -torch.nn.functional.softplus(a), b.sigmoid()
    whole = GATED_DELTA(query, key, value, g=g, beta=beta, use_qk_l2norm_in_kernel=True)[0]
    alone = each_alone(lambda q, k, v, g_, b_: GATED_DELTA(q, k, v, g=g_, beta=b_, use_qk_l2norm_in_kernel=True)[0],
                       [query, key, value, g, beta], 1)
    assert (whole - alone)[:, LENGTHS[0]:].abs().max() > 0.1


def test_layouts():
    cu = torch.tensor([0, 3, 4, 9])
    conv = restarts.gapped(cu, 2)
    assert conv.index.tolist() == [0, 1, 2, 5, 8, 9, 10, 11, 12] and conv.length == 13
    (scan,) = restarts.scan_layout(cu, 4).waves  # 1, 1 and 2 chunks: the longest in row 0, the two others in row 1
    assert scan.index.tolist() == [8, 9, 10, 12, 0, 1, 2, 3, 4] and scan.wipes.tolist() == [11, 15, 7]
    assert (scan.length, scan.rows, scan.carry.tolist()) == (16, 2, [-1, -1])
    first, second = restarts.scan_layout(cu, 4, 4).waves  # rows of one chunk: the longest in two pieces
    assert first.tokens.tolist() == list(range(8)) and first.index.tolist() == [4, 5, 6, 8, 0, 1, 2, 3]
    assert first.wipes.tolist() == [7, 11] and (first.rows, first.carry.tolist()) == (3, [-1, -1, -1])
    assert second.tokens.tolist() == [8] and second.index.tolist() == [0] and second.wipes.tolist() == [3]
    assert second.carry.tolist() == [0]


class OpCount(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def ops_of(model, lengths) -> int:
    """Operations of one forward and backward of a packed row of sequences of ``lengths``."""
    ids = torch.arange(sum(lengths)) % 50 + 1
    batch = collate_packed([{"input_ids": ids, "labels": ids, "seq_lens": lengths}])
    with OpCount() as count:
        model(**batch).loss.backward()
    return count.ops


@pytest.mark.parametrize("family", ["qwen3_5", "bamba"])
def test_the_fallback_does_not_loop_over_sequences(family):
    """A row of 8 sequences costs the operations of a row of 2 (one chunk of 64 each): one call of the layer's
    function whatever the number of sequences, the sequences its batch (the per-sequence path made 8 calls)."""
    torch.manual_seed(0)
    shape = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1, use_cache=False)
    if family == "qwen3_5":
        config = transformers.Qwen3_5TextConfig(head_dim=16, linear_num_key_heads=1, linear_num_value_heads=2,
                                                linear_key_head_dim=16, linear_value_head_dim=16,
                                                layer_types=["linear_attention", "full_attention"], **shape)
    else:
        config = transformers.BambaConfig(mamba_n_heads=2, mamba_d_head=32, mamba_d_state=8, mamba_chunk_size=64,
                                          attn_layer_indices=[1], **shape)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    register_packed_layers(model)
    two, eight = ops_of(model, [63] * 2), ops_of(model, [63] * 8)
    assert eight == two, (two, eight)

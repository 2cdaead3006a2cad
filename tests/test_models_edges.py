"""Edge inputs of jaxopt_train.models: cuDNN attention shapes, remat with a kernel
dot_general, sequence lengths, numpy scalars in the config, and loss inputs."""

import dataclasses
import re
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.ad_checkpoint import print_saved_residuals

from jaxopt_train.models import GPT, get_gpt_config, gpt_loss
from jaxopt_train.models import gpt as gpt_module

HIGHEST = jax.lax.Precision.HIGHEST
SMALL = dict(n_layers=2, d_model=32, n_heads=4, seq_len=24, vocab_size=61)


def small_cfg(**overrides):
    return get_gpt_config("gpt-tiny", **{**SMALL, **overrides})


def causal_attention_reference(q, k, v):
    """softmax(QK^T / sqrt(d) + causal mask) V in float32 plain jnp."""
    length, head_dim = q.shape[1], q.shape[-1]
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k, precision=HIGHEST) / np.sqrt(head_dim)
    scores = jnp.where(np.tril(np.ones((length, length), bool)), scores, -jnp.inf)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, -1), v, precision=HIGHEST)


# ---------------------------------------------------------------- cuDNN attention


@pytest.mark.parametrize("length", [1, 7, 16, 17])
def test_even_padding_keeps_causal_attention_exact(length):
    """The pad that lets cuDNN take an odd length changes no output nor gradient."""
    q, k, v = jax.random.normal(jax.random.key(length), (3, 2, length, 2, 8))

    def padded(q, k, v):
        pad = length % 2
        y = gpt_module.causal_attention(*(gpt_module._pad_time(a, pad) for a in (q, k, v)), "xla")
        return y[:, :length]

    with jax.default_matmul_precision("highest"):
        got = jax.jit(padded)(q, k, v)
        got_grads = jax.jit(jax.grad(lambda *a: jnp.sum(padded(*a) ** 2), argnums=(0, 1, 2)))(q, k, v)
    want = causal_attention_reference(q, k, v)
    want_grads = jax.grad(lambda *a: jnp.sum(causal_attention_reference(*a) ** 2), argnums=(0, 1, 2))(
        q, k, v)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    for a, b in zip(got_grads, want_grads):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_cudnn_path_pads_odd_lengths_and_matches_the_plain_model(monkeypatch):
    """cuDNN's backward refuses an odd length (seen on an H200: "Unsupported sequence
    length Q 17, KV 17"). The model must hand it an even one and still compute the
    same logits. cuDNN itself is stood in for by XLA here (CPU)."""
    seen = []
    real = jax.nn.dot_product_attention

    def recording(q, k, v, **kwargs):
        seen.append((q.shape[1], kwargs["implementation"]))
        return real(q, k, v, **{**kwargs, "implementation": "xla"})

    monkeypatch.setattr(jax.nn, "dot_product_attention", recording)
    monkeypatch.setattr(gpt_module, "_attention_implementation", lambda name: name)
    cfg = small_cfg(attention="cudnn", dtype="bf16", n_layers=1)
    cudnn_model = GPT(cfg, rngs=nnx.Rngs(0))
    xla_model = GPT(dataclasses.replace(cfg, attention="xla", dtype="f32"), rngs=nnx.Rngs(0))
    tokens = jax.random.randint(jax.random.key(1), (2, 17), 0, cfg.vocab_size)
    got = cudnn_model(tokens).astype(jnp.float32)
    assert seen == [(18, "cudnn")]
    want = xla_model(tokens)
    np.testing.assert_allclose(got, want, atol=0.05)


@pytest.mark.parametrize("d_model, n_heads", [(256, 1), (272, 2), (512, 2)])
def test_cudnn_config_accepts_head_dims_up_to_256(d_model, n_heads):
    # JAX runs cuDNN flash attention with head_dim up to 256 on Hopper (checked on
    # an H200: 136, 192 and 256 match XLA, forward and grad); 128 was our old limit.
    cfg = small_cfg(attention="cudnn", dtype="bf16", d_model=d_model, n_heads=n_heads)
    assert cfg.head_dim == d_model // n_heads <= 256


def test_cudnn_config_refuses_head_dims_cudnn_cannot_take():
    with pytest.raises(ValueError, match=r"head_dim <= 256 .*got head_dim=264.*attention='xla'"):
        small_cfg(attention="cudnn", dtype="bf16", d_model=528, n_heads=2)


def _fake_gpu(monkeypatch, capability: str, kind: str = "Tesla T4"):
    """jax.default_backend() says "gpu" and jax.devices() one GPU of `capability`."""
    gpu = SimpleNamespace(platform="gpu", device_kind=kind, compute_capability=capability)
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(jax, "devices", lambda *args, **kwargs: [gpu])
    monkeypatch.setattr(jax, "local_devices", lambda *args, **kwargs: [gpu])


def test_cudnn_attention_before_ampere_raises_naming_the_gpu(monkeypatch):
    """On a T4 (7.5) attention="cudnn" went on to JAX, which checks the head_dim but not the
    GPU, and cuDNN's fused attention needs sm_80: the step failed inside XLA instead."""
    cfg = small_cfg(attention="cudnn", dtype="bf16")
    model = nnx.eval_shape(lambda: GPT(cfg, rngs=nnx.Rngs(0)))
    _fake_gpu(monkeypatch, "7.5")
    message = ("attention='cudnn' needs an NVIDIA Ampere or newer GPU (compute capability >= 8.0) "
               "but Tesla T4 has compute_capability='7.5'; use attention='auto' or 'xla'")
    with pytest.raises(ValueError, match=re.escape(message)):
        nnx.eval_shape(lambda m, x: m(x), model, jnp.zeros((2, cfg.seq_len), jnp.int32))
    with pytest.warns(UserWarning, match="Ampere or newer.*falling back to attention='xla'"):
        assert gpt_module.warn_if_cudnn_unavailable(cfg).attention == "xla"
    for capability in ("8.0", "8.9", "9.0"):  # A100, L4, H100/H200: unchanged
        _fake_gpu(monkeypatch, capability, "NVIDIA A100-SXM4-40GB")
        assert gpt_module.cudnn_attention_unavailable() is None
        assert gpt_module._attention_implementation("cudnn") == "cudnn"
        assert gpt_module.warn_if_cudnn_unavailable(cfg) is cfg


# ---------------------------------------------------------------- remat


def _saved_shapes(cfg, capsys):
    """The shapes of the activations remat saves for the backward (not the arguments)."""
    model = nnx.eval_shape(lambda: GPT(cfg, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(model)
    tokens = jnp.zeros((2, cfg.seq_len), jnp.int32)
    capsys.readouterr()
    with jax.numpy_dtype_promotion("standard"):
        print_saved_residuals(lambda s: gpt_loss(nnx.merge(graphdef, s)(tokens), tokens), state)
    lines = capsys.readouterr().out.splitlines()
    return sorted(line.split()[0] for line in lines if "from the argument" not in line)


def test_remat_dots_saves_dense_outputs_of_a_kernel_dot_general(capsys):
    """With a Pallas matmul as dot_general no `dot_general` primitive is left for
    `dots_with_no_batch_dims_saveable` to find: "dots" used to save exactly what
    "full" saves. Now every dense output is saved, as with XLA's dot_general."""
    from jaxopt_train.kernels import make_dot_general

    base = small_cfg(n_layers=1, dtype="bf16", vocab_size=64, seq_len=16)
    d = base.d_model
    # q/k/v, the MLP's first layer, and one [.., d] output (the attention input of
    # the out projection's backward); the rest of the block is recomputed.
    dense = sorted(f"bf16[2,16,{width}]" for width in (3 * d, d, 4 * d))
    for dot_general in (None, make_dot_general("interpret")):
        extra = _saved_beyond(dataclasses.replace(base, dot_general=dot_general), "dots", "full", capsys)
        assert sorted(extra) == dense, (dot_general, extra)


def _saved_beyond(cfg, remat, other, capsys):
    """The residual shapes that remat policy `remat` saves beyond what `other` saves."""
    more, fewer = (_saved_shapes(dataclasses.replace(cfg, remat=r), capsys) for r in (remat, other))
    for shape in fewer:
        more.remove(shape)
    return more


def test_remat_dots_attention_saves_the_attention_output_too(capsys):
    """"dots_attention" = "dots" + the attention's [batch, time, heads, head_dim]
    output, whatever computes the dense layers (on GPU also cuDNN's softmax
    statistics: tests/test_models.py::test_remat_dots_attention_runs_cudnn_forward_once_on_gpu)."""
    from jaxopt_train.kernels import make_dot_general

    base = small_cfg(n_layers=2, dtype="bf16", vocab_size=64, seq_len=16)
    for dot_general in (None, make_dot_general("interpret")):
        extra = _saved_beyond(dataclasses.replace(base, dot_general=dot_general), "dots_attention",
                              "dots", capsys)
        assert extra == [f"bf16[2,16,{base.n_heads},{base.head_dim}]"] * base.n_layers, extra


def test_dots_attention_policy_names_jax_cudnn_attention_forward():
    """The policy saves cuDNN attention's forward by its primitive's name: this fails
    if JAX renames it (the policy would silently recompute the forward again)."""
    from jax._src.cudnn import fused_attention_stablehlo as cudnn_attention

    from jaxopt_train.models import gpt

    forward = cudnn_attention._dot_product_attention_fwd_p_wrapper
    policy = gpt._remat_policy("dots_attention")
    assert policy(forward) and not gpt._remat_policy("dots")(forward)
    assert not policy(cudnn_attention._dot_product_attention_bwd_p_wrapper)
    assert not policy(jax.lax.exp_p)


@pytest.mark.parametrize("remat", ["dots", "dots_attention"])
@pytest.mark.parametrize("split_qkv", [False, True])
def test_remat_dots_gradients_match_no_remat(split_qkv, remat):
    tokens = jax.random.randint(jax.random.key(0), (2, 16), 0, 61)

    def grads(cfg):
        model = GPT(cfg, rngs=nnx.Rngs(3))
        return nnx.jit(nnx.value_and_grad(
            lambda m: gpt_loss(m(tokens[:, :-1]), tokens[:, 1:])))(model)

    with jax.default_matmul_precision("highest"):
        (want_loss, want), (got_loss, got) = (
            grads(small_cfg(remat=r, split_qkv=split_qkv)) for r in ("none", remat))
    np.testing.assert_allclose(got_loss, want_loss, rtol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7),
                 nnx.to_pure_dict(got), nnx.to_pure_dict(want))


# ---------------------------------------------------------------- tokens and config


def test_embed_refuses_sequences_longer_than_seq_len():
    """`embed` is public (the data-parallel embedding exchange calls it); past seq_len
    the position lookup returned NaN rows without a word."""
    model = GPT(small_cfg(), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="sequence length 25 exceeds config seq_len=24"):
        model.embed(jnp.zeros((1, 25), jnp.int32))
    with pytest.raises(ValueError, match=r"tokens must be ids in \[0, 61\)"):
        model.embed(jnp.array([[0, 61]], jnp.int32))


def test_tokens_as_nested_lists_give_the_array_logits():
    model = GPT(small_cfg(n_layers=1), rngs=nnx.Rngs(0))
    tokens = [[1, 2, 3], [4, 5, 6]]
    np.testing.assert_array_equal(model(tokens), model(jnp.array(tokens, jnp.int32)))
    with pytest.raises(ValueError, match=r"integer array \[batch, time\], got shape=\(3,\)"):
        model([1, 2, 3])


def test_config_takes_numpy_scalars_as_python_numbers():
    """A vocab computed from data (np.max(ids) + 1) is a numpy int; it was refused with
    "vocab_size=np.int64(300) must be a positive int"."""
    cfg = small_cfg(vocab_size=np.int64(300), n_layers=np.int32(1), layer_norm_epsilon=np.float32(1e-6))
    assert cfg.vocab_size == 300 and type(cfg.vocab_size) is int and type(cfg.n_layers) is int
    assert type(cfg.layer_norm_epsilon) is float
    assert cfg.layer_norm_epsilon == pytest.approx(1e-6)
    assert GPT(cfg, rngs=nnx.Rngs(0))(jnp.zeros((1, 3), jnp.int32)).shape == (1, 3, 300)
    for bad in (True, np.bool_(True), 2.0, "3", -1):
        with pytest.raises(ValueError, match="n_layers=.* must be a positive int"):
            small_cfg(n_layers=bad)
    with pytest.raises(ValueError, match="init_std=np.True_ must be a finite number > 0"):
        small_cfg(init_std=np.bool_(True))


# ---------------------------------------------------------------- loss inputs


def test_gpt_loss_takes_lists_and_refuses_integer_logits():
    logits = jax.random.normal(jax.random.key(0), (2, 3, 5))
    targets = [[0, 1, 2], [3, 4, 0]]
    np.testing.assert_allclose(gpt_loss(logits, targets), gpt_loss(logits, jnp.array(targets)))
    with pytest.raises(ValueError, match=r"logits must be a floating array .*dtype=int32"):
        gpt_loss(jnp.zeros((2, 3, 5), jnp.int32), jnp.array(targets))


# ---------------------------------------------------------------- on a GPU


@pytest.mark.gpu
@pytest.mark.parametrize("d_model, n_heads, length", [(512, 2, 32), (128, 2, 17), (128, 2, 1)])
def test_cudnn_gpt_matches_xla_on_gpu(d_model, n_heads, length):
    """head_dim 256 (Hopper) and odd lengths through cuDNN, forward and grad."""
    cfg = small_cfg(dtype="bf16", d_model=d_model, n_heads=n_heads, attention="cudnn", seq_len=32)
    tokens = jax.random.randint(jax.random.key(0), (2, length + 1), 0, cfg.vocab_size)

    def loss_and_grads(cfg):
        model = GPT(cfg, rngs=nnx.Rngs(0))
        return nnx.jit(nnx.value_and_grad(
            lambda m: gpt_loss(m(tokens[:, :-1]), tokens[:, 1:])))(model)

    # XLA attention's bf16 backward compiles only under standard promotion (see gpt.py).
    with jax.numpy_dtype_promotion("standard"):
        (got_loss, got), (want_loss, want) = (
            loss_and_grads(dataclasses.replace(cfg, attention=a)) for a in ("cudnn", "xla"))
    np.testing.assert_allclose(got_loss, want_loss, rtol=1e-2)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(
        np.asarray(a, np.float32), np.asarray(b, np.float32), atol=2e-2, rtol=5e-2),
        nnx.to_pure_dict(got), nnx.to_pure_dict(want))


def test_ids_of_other_hosts_are_not_fetched():
    """A multi-host global array (not fully addressable) cannot be read by np.asarray,
    which raised RuntimeError from every eager model call; it is left to the NaN path."""
    from jaxopt_train.models.losses import check_ids_in_range

    class GlobalIds:  # what such an array shows this check
        is_fully_addressable = False
        shape, ndim = (1, 2), 2

        def __array__(self, *args, **kwargs):
            raise RuntimeError("Fetching value for `jax.Array` that spans non-addressable devices")

    check_ids_in_range(GlobalIds(), 10, "tokens")  # no error
    with pytest.raises(ValueError, match=r"tokens must be ids in \[0, 10\)"):
        check_ids_in_range(jnp.array([[3, 10]]), 10, "tokens")


def test_gpt_loss_refuses_an_empty_batch():
    with pytest.raises(ValueError, match=r"at least one target token; got targets shape \(0, 5\)"):
        gpt_loss(jnp.zeros((0, 5, 7)), jnp.zeros((0, 5), jnp.int32))


def test_ids_check_passes_traced_ids_through():
    """Inside jit the ids cannot be read: the check must not touch them (it raised
    ConcretizationTypeError from a property read, breaking every jitted loss)."""
    from jaxopt_train.models.losses import check_ids_in_range

    out = jax.jit(lambda x: (check_ids_in_range(x, 10, "t"), x)[1])(jnp.array([3, 11], jnp.int32))
    np.testing.assert_array_equal(out, [3, 11])


@pytest.mark.parametrize("dtype", [jnp.int8, jnp.int16, jnp.int32])
def test_negative_traced_ids_give_nan_rows_whatever_the_token_dtype(dtype):
    # Under jit the ids cannot be checked; a negative one must not pass as a real token.
    # int8/int16 ids had vocab_size wrap round in their own dtype (to 0, or -15232 ->
    # row 35072 of 50304): a real row, silently.
    vocab = 256 if dtype == jnp.int8 else 50304
    cfg = small_cfg(n_layers=1, vocab_size=vocab, d_model=16, n_heads=2)
    model = nnx.eval_shape(lambda: GPT(cfg, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(model)
    state = jax.tree.map(lambda x: jnp.full(x.shape, 0.01, x.dtype), state)
    embed = jax.jit(lambda s, t: nnx.merge(graphdef, s).embed(t))
    rows = embed(state, jnp.asarray([[-1, 3]], dtype))
    assert bool(jnp.all(jnp.isnan(rows[0, 0]))) and bool(jnp.all(jnp.isfinite(rows[0, 1])))


@pytest.mark.parametrize("bad_id", [2**31, 2**32 - 1])
def test_uint32_traced_ids_past_int32_give_nan_rows_not_the_last_row(bad_id):
    # The int32 cast turned 2**32 - 1 into -1, which read the last embedding row silently.
    cfg = small_cfg(n_layers=1, d_model=16, n_heads=2)
    model = nnx.eval_shape(lambda: GPT(cfg, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(model)
    state = jax.tree.map(lambda x: jnp.full(x.shape, 0.01, x.dtype), state)
    embed = jax.jit(lambda s, t: nnx.merge(graphdef, s).embed(t))
    rows = embed(state, jnp.asarray([[bad_id, 3]], jnp.uint32))
    assert bool(jnp.all(jnp.isnan(rows[0, 0]))) and bool(jnp.all(jnp.isfinite(rows[0, 1])))

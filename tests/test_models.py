"""Tests for jaxopt_train.models: GPT against a pure-jnp reference, and the ResNets."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxopt_train.models import GPT, GPT_PRESETS, get_gpt_config, gpt_loss, gpt_param_count

HIGHEST = jax.lax.Precision.HIGHEST
SMALL = dict(n_layers=2, d_model=32, n_heads=4, seq_len=16, vocab_size=64)


def small_cfg(**overrides):
    return get_gpt_config("gpt-tiny", **{**SMALL, **overrides})


def tokens_for(cfg, batch=2, length=None, seed=0):
    length = cfg.seq_len if length is None else length
    return jax.random.randint(jax.random.key(seed), (batch, length), 0, cfg.vocab_size)


# ---------------------------------------------------------------- reference GPT


def _ref_layer_norm(x, p, eps):
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / jnp.sqrt(var + eps) * p["scale"] + p["bias"]


def _ref_dense(x, p):
    return jnp.dot(x, p["kernel"], precision=HIGHEST) + p.get("bias", 0.0)


def _ref_block(x, p, cfg):
    b, t, d = x.shape
    h = _ref_layer_norm(x, p["ln1"], cfg.layer_norm_epsilon)
    q, k, v = jnp.split(_ref_dense(h, p["attn"]["qkv"]), 3, axis=-1)
    q, k, v = (a.reshape(b, t, cfg.n_heads, cfg.head_dim) for a in (q, k, v))
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k, precision=HIGHEST) / np.sqrt(cfg.head_dim)
    causal = np.tril(np.ones((t, t), bool))
    scores = jnp.where(causal, scores, -jnp.inf)
    y = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, -1), v, precision=HIGHEST)
    x = x + _ref_dense(y.reshape(b, t, d), p["attn"]["out"])
    h = _ref_layer_norm(x, p["ln2"], cfg.layer_norm_epsilon)
    fc = jax.nn.gelu(_ref_dense(h, p["mlp"]["fc"]), approximate=True)
    return x + _ref_dense(fc, p["mlp"]["proj"])


def reference_gpt(params, tokens, cfg):
    """The GPT forward pass in float32 plain jnp, from the model's pure-dict params."""
    t = tokens.shape[1]
    x = params["wte"]["embedding"][tokens] + params["wpe"]["embedding"][:t][None]
    for i in range(cfg.n_layers):
        x = _ref_block(x, params["blocks"][i], cfg)
    x = _ref_layer_norm(x, params["ln_f"], cfg.layer_norm_epsilon)
    head = params["wte"]["embedding"].T if cfg.tie_embeddings else params["head"]["kernel"]
    return jnp.dot(x, head, precision=HIGHEST)


def pure_params(model):
    return nnx.to_pure_dict(nnx.state(model, nnx.Param))


# ---------------------------------------------------------------- GPT tests


@pytest.mark.parametrize(
    "overrides",
    [dict(), dict(tie_embeddings=False, use_bias=False), dict(n_layers=1, mlp_ratio=2)],
)
def test_gpt_matches_reference(overrides):
    cfg = small_cfg(**overrides)
    model = GPT(cfg, rngs=nnx.Rngs(0))
    tokens = tokens_for(cfg, length=12)
    with jax.default_matmul_precision("highest"):
        logits = nnx.jit(lambda m, x: m(x))(model, tokens)
    want = reference_gpt(pure_params(model), tokens, cfg)
    assert logits.shape == (2, 12, cfg.vocab_size) and logits.dtype == jnp.float32
    np.testing.assert_allclose(logits, want, rtol=2e-5, atol=2e-5)


def test_gpt_is_causal():
    cfg = small_cfg()
    model = GPT(cfg, rngs=nnx.Rngs(1))
    tokens = tokens_for(cfg)
    changed = tokens.at[:, 10:].set((tokens[:, 10:] + 1) % cfg.vocab_size)
    a, b = model(tokens), model(changed)
    np.testing.assert_array_equal(a[:, :10], b[:, :10])
    assert not np.allclose(a[:, 10:], b[:, 10:])


def test_gpt_bf16_compute_close_to_f32():
    cfg32 = small_cfg()
    cfg16 = dataclasses.replace(cfg32, dtype=jnp.bfloat16)
    m32, m16 = GPT(cfg32, rngs=nnx.Rngs(2)), GPT(cfg16, rngs=nnx.Rngs(2))
    tokens = tokens_for(cfg32)
    out16 = m16(tokens)
    assert out16.dtype == jnp.bfloat16
    assert jax.tree.leaves(nnx.state(m16, nnx.Param))[0].dtype == jnp.float32
    np.testing.assert_allclose(out16.astype(jnp.float32), m32(tokens), atol=0.05)


def test_param_dtype_is_storage_dtype():
    cfg = small_cfg(param_dtype="bf16", dtype="bf16")
    model = GPT(cfg, rngs=nnx.Rngs(0))
    dtypes = {leaf.dtype for leaf in jax.tree.leaves(nnx.state(model, nnx.Param))}
    assert dtypes == {jnp.dtype(jnp.bfloat16)}
    assert model(tokens_for(cfg)).dtype == jnp.bfloat16


def _copy_stacked_into_unrolled(scanned, unrolled):
    stacked = pure_params(scanned)
    flat = {k: v for k, v in stacked.items() if k != "blocks"}
    flat["blocks"] = {
        i: jax.tree.map(lambda a, i=i: a[i], stacked["blocks"])
        for i in range(scanned.config.n_layers)
    }
    state = nnx.state(unrolled, nnx.Param)
    nnx.replace_by_pure_dict(state, flat)
    nnx.update(unrolled, state)


def test_scan_layers_equals_unrolled_with_same_weights():
    scanned = GPT(small_cfg(scan_layers=True), rngs=nnx.Rngs(3))
    unrolled = GPT(small_cfg(), rngs=nnx.Rngs(4))
    _copy_stacked_into_unrolled(scanned, unrolled)
    tokens = tokens_for(scanned.config)
    with jax.default_matmul_precision("highest"):
        np.testing.assert_allclose(scanned(tokens), unrolled(tokens), rtol=1e-5, atol=1e-5)
    stacked_shape = pure_params(scanned)["blocks"]["mlp"]["fc"]["kernel"].shape
    assert stacked_shape == (2, 32, 128)


def _grads(model, tokens):
    @nnx.jit
    def step(model, tokens):
        loss_fn = lambda m: gpt_loss(m(tokens[:, :-1]), tokens[:, 1:])  # noqa: E731
        return nnx.value_and_grad(loss_fn)(model)

    return step(model, tokens)


@pytest.mark.parametrize("scan_layers", [False, True])
def test_remat_does_not_change_gradients(scan_layers):
    tokens = tokens_for(small_cfg(), batch=2)
    results = {}
    for remat in ("none", "dots", "full"):
        model = GPT(small_cfg(remat=remat, scan_layers=scan_layers), rngs=nnx.Rngs(5))
        results[remat] = _grads(model, tokens)
    for remat in ("dots", "full"):
        np.testing.assert_allclose(results[remat][0], results["none"][0], rtol=1e-6)
        jax.tree.map(
            lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
            results[remat][1], results["none"][1],
        )


def test_full_remat_recomputes_in_backward():
    # "none" saves activations, "full" must recompute them: the jaxpr of the
    # gradient contains remat (checkpoint) equations only when asked for.
    tokens = tokens_for(small_cfg())
    for remat, expected in (("none", False), ("full", True)):
        model = GPT(small_cfg(remat=remat), rngs=nnx.Rngs(0))
        graphdef, state = nnx.split(model)

        def loss(state):
            return gpt_loss(nnx.merge(graphdef, state)(tokens[:, :-1]), tokens[:, 1:])

        jaxpr = str(jax.make_jaxpr(jax.grad(loss))(state))
        assert ("remat" in jaxpr or "checkpoint" in jaxpr) == expected, remat


@pytest.mark.parametrize("tie_embeddings", [True, False])
@pytest.mark.parametrize("scan_layers", [False, True])
def test_dot_general_is_used_by_every_dense_layer(tie_embeddings, scan_layers):
    shapes = []

    def counting_dot_general(lhs, rhs, dimension_numbers, precision=None, **kwargs):
        shapes.append(rhs.shape)
        return jax.lax.dot_general(lhs, rhs, dimension_numbers, precision=precision, **kwargs)

    cfg = small_cfg(
        dot_general=counting_dot_general, tie_embeddings=tie_embeddings, scan_layers=scan_layers
    )
    model = GPT(cfg, rngs=nnx.Rngs(0))
    plain = GPT(dataclasses.replace(cfg, dot_general=None), rngs=nnx.Rngs(0))
    tokens = tokens_for(cfg)
    np.testing.assert_array_equal(model(tokens), plain(tokens))
    d, v = cfg.d_model, cfg.vocab_size
    per_block = [(d, 3 * d), (d, d), (d, 4 * d), (4 * d, d)]
    # A scanned body is traced once for all layers.
    layers = 1 if scan_layers else cfg.n_layers
    assert sorted(shapes) == sorted(per_block * layers + [(d, v)])


def test_attention_implementations_agree_on_cpu():
    base = small_cfg()
    tokens = tokens_for(base)
    auto = GPT(base, rngs=nnx.Rngs(0))(tokens)
    xla = GPT(dataclasses.replace(base, attention="xla"), rngs=nnx.Rngs(0))(tokens)
    np.testing.assert_allclose(auto, xla, rtol=1e-6, atol=1e-6)


def test_cudnn_attention_on_cpu_raises_clearly():
    if jax.default_backend() == "gpu":
        pytest.skip("this checks the CPU error")
    model = GPT(small_cfg(attention="cudnn", dtype="bf16"), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="needs a CUDA GPU.*'auto' or 'xla'"):
        model(tokens_for(model.config))


@pytest.mark.gpu
def test_cudnn_attention_matches_xla_on_gpu():
    cfg = small_cfg(dtype="bf16", d_model=128, n_heads=2, attention="cudnn")
    tokens = tokens_for(cfg)
    cudnn = GPT(cfg, rngs=nnx.Rngs(0))(tokens)
    xla = GPT(dataclasses.replace(cfg, attention="xla"), rngs=nnx.Rngs(0))(tokens)
    np.testing.assert_allclose(
        cudnn.astype(jnp.float32), xla.astype(jnp.float32), atol=0.05, rtol=0.05
    )


def test_param_count_matches_real_model_for_every_preset():
    for name in GPT_PRESETS:
        for tie in (True, False):
            cfg = get_gpt_config(name, scan_layers=True, tie_embeddings=tie)
            abstract = nnx.eval_shape(lambda cfg=cfg: GPT(cfg, rngs=nnx.Rngs(0)))
            real = sum(x.size for x in jax.tree.leaves(nnx.state(abstract, nnx.Param)))
            assert real == gpt_param_count(cfg), (name, tie)
    cfg = small_cfg(use_bias=False)
    real = sum(x.size for x in jax.tree.leaves(nnx.state(GPT(cfg, rngs=nnx.Rngs(0)))))
    assert real == gpt_param_count(cfg)


@pytest.mark.parametrize("logits_dtype", [jnp.float32, jnp.bfloat16])
def test_gpt_loss_matches_reference(logits_dtype):
    logits = jax.random.normal(jax.random.key(0), (3, 5, 11)).astype(logits_dtype)
    targets = jax.random.randint(jax.random.key(1), (3, 5), 0, 11)
    loss = jax.jit(gpt_loss)(logits, targets)
    log_probs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    want = -jnp.take_along_axis(log_probs, targets[..., None], axis=-1).mean()
    assert loss.dtype == jnp.float32 and loss.shape == ()
    np.testing.assert_allclose(loss, want, rtol=1e-6)


def test_gpt_loss_bad_inputs():
    with pytest.raises(ValueError, match="targets shape"):
        gpt_loss(jnp.zeros((2, 3, 4)), jnp.zeros((2, 4), jnp.int32))
    with pytest.raises(ValueError, match="integer"):
        gpt_loss(jnp.zeros((2, 3, 4)), jnp.zeros((2, 3)))


@pytest.mark.parametrize(
    "overrides, match",
    [
        (dict(dmodel=3), "unknown GPTConfig field.*legal fields"),
        (dict(attention="flash"), r"attention='flash'; legal values: \('auto', 'xla', 'cudnn'\)"),
        (dict(remat="some"), "remat='some'; legal values"),
        (dict(d_model=30, n_heads=4), "d_model=30 must be divisible by n_heads=4"),
        (dict(n_layers=0), "n_layers=0 must be a positive int"),
        (dict(seq_len=1.5), "seq_len=1.5 must be a positive int"),
        (dict(dtype="int8"), "dtype='int8' must be float32, bfloat16 or float16"),
        (dict(param_dtype="bogus"), "param_dtype='bogus' is not a dtype"),
        (dict(scan_layers="yes"), "scan_layers='yes' must be True or False"),
        (dict(dot_general=3), "dot_general=3 must be callable"),
        (dict(attention="cudnn"), "needs dtype bfloat16 or float16"),
        (dict(attention="cudnn", dtype="bf16", d_model=36, n_heads=4), "head_dim % 8"),
    ],
)
def test_config_validation(overrides, match):
    with pytest.raises(ValueError, match=match):
        get_gpt_config("gpt-tiny", **overrides)


def test_unknown_preset_and_bad_tokens():
    with pytest.raises(ValueError, match="not a GPT preset; legal values.*gpt-tiny"):
        get_gpt_config("gpt-2")
    model = GPT(small_cfg(), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="exceeds config seq_len=16"):
        model(jnp.zeros((1, 17), jnp.int32))
    with pytest.raises(ValueError, match="integer array"):
        model(jnp.zeros((1, 4), jnp.float32))
    with pytest.raises(TypeError, match="GPTConfig"):
        GPT({"d_model": 3}, rngs=nnx.Rngs(0))

"""Tests for jaxopt_train.models: GPT against a pure-jnp reference, and the ResNets."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jaxopt_train.models import GPT, GPT_PRESETS, get_gpt_config, gpt_loss, gpt_param_count
from jaxopt_train.models.gpt import softmax_cross_entropy

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
    [dict(), dict(tie_embeddings=False, use_bias=False, mlp_ratio=2)],
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
    forward = nnx.jit(lambda m, x: m(x))
    a, b = forward(model, tokens), forward(model, changed)
    np.testing.assert_array_equal(a[:, :10], b[:, :10])
    assert not np.allclose(a[:, 10:], b[:, 10:])


def test_gpt_bf16_compute_close_to_f32():
    cfg32 = small_cfg()
    cfg16 = dataclasses.replace(cfg32, dtype=jnp.bfloat16)
    m32, m16 = GPT(cfg32, rngs=nnx.Rngs(2)), GPT(cfg16, rngs=nnx.Rngs(2))
    tokens = tokens_for(cfg32)
    out16, out32 = nnx.jit(lambda a, b, x: (a(x), b(x)))(m16, m32, tokens)
    assert out16.dtype == jnp.bfloat16
    assert jax.tree.leaves(nnx.state(m16, nnx.Param))[0].dtype == jnp.float32
    np.testing.assert_allclose(out16.astype(jnp.float32), out32, atol=0.05)


def test_param_dtype_is_storage_dtype():
    cfg = small_cfg(param_dtype="bf16", dtype="bf16")
    model = nnx.eval_shape(lambda: GPT(cfg, rngs=nnx.Rngs(0)))
    dtypes = {leaf.dtype for leaf in jax.tree.leaves(nnx.state(model, nnx.Param))}
    assert dtypes == {jnp.dtype(jnp.bfloat16)}
    assert nnx.eval_shape(lambda m, x: m(x), model, tokens_for(cfg)).dtype == jnp.bfloat16


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


@nnx.jit  # module level: models with equal configs share one compilation
def _grads(model, tokens):
    loss_fn = lambda m: gpt_loss(m(tokens[:, :-1]), tokens[:, 1:])  # noqa: E731
    return nnx.value_and_grad(loss_fn)(model)


def _assert_grads_close(got, want):
    np.testing.assert_allclose(got[0], want[0], rtol=1e-6)
    got_grads, want_grads = nnx.to_pure_dict(got[1]), nnx.to_pure_dict(want[1])
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), got_grads, want_grads)


def test_remat_and_scan_layers_do_not_change_gradients():
    tokens = tokens_for(small_cfg(), batch=2)
    plain = GPT(small_cfg(), rngs=nnx.Rngs(5))
    want = _grads(plain, tokens)
    dots = GPT(small_cfg(remat="dots"), rngs=nnx.Rngs(5))
    _assert_grads_close(_grads(dots, tokens), want)
    # Scanned + fully rematerialised, with the same weights as `plain`.
    scanned = GPT(small_cfg(remat="full", scan_layers=True), rngs=nnx.Rngs(6))
    unrolled_copy = GPT(small_cfg(), rngs=nnx.Rngs(6))
    _copy_stacked_into_unrolled(scanned, unrolled_copy)
    loss, grads = _grads(scanned, tokens)
    stacked = nnx.to_pure_dict(grads)
    assert stacked["blocks"]["mlp"]["fc"]["kernel"].shape == (2, 32, 128)  # really stacked
    stacked["blocks"] = {
        i: jax.tree.map(lambda a, i=i: a[i], stacked["blocks"]) for i in range(2)
    }
    want_loss, want_grads = _grads(unrolled_copy, tokens)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-6)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
        stacked, nnx.to_pure_dict(want_grads),
    )


@pytest.mark.parametrize("overrides", [dict(), dict(use_bias=False, scan_layers=True, remat="dots")])
def test_split_qkv_matches_the_fused_product(overrides):
    # Same parameters (split_qkv only changes how the product is launched), so the
    # losses and every gradient, incl. the fused qkv kernel's, must agree.
    tokens = tokens_for(small_cfg(), batch=2)
    fused = GPT(small_cfg(**overrides), rngs=nnx.Rngs(7))
    split = GPT(small_cfg(split_qkv=True, **overrides), rngs=nnx.Rngs(7))
    assert jax.tree.structure(nnx.to_pure_dict(nnx.state(split))) == jax.tree.structure(
        nnx.to_pure_dict(nnx.state(fused)))
    with jax.default_matmul_precision("highest"):
        got, want = _grads(split, tokens), _grads(fused, tokens)
    _assert_grads_close(got, want)


def test_column_blocks_bad_split():
    layer = GPT(small_cfg(), rngs=nnx.Rngs(0)).blocks[0].attn.qkv
    with pytest.raises(ValueError, match="96 output columns do not split into 5 blocks"):
        layer.column_blocks(jnp.ones((2, 32)), 5)


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


@pytest.mark.parametrize("split_qkv", [False, True])
@pytest.mark.parametrize("tie_embeddings", [True, False])
@pytest.mark.parametrize("scan_layers", [False, True])
def test_dot_general_is_used_by_every_dense_layer(tie_embeddings, scan_layers, split_qkv):
    shapes = []

    def counting_dot_general(lhs, rhs, dimension_numbers, precision=None, **kwargs):
        shapes.append((rhs.shape, tuple(dimension_numbers[0][1])))
        return jax.lax.dot_general(lhs, rhs, dimension_numbers, precision=precision, **kwargs)

    cfg = small_cfg(
        dot_general=counting_dot_general, tie_embeddings=tie_embeddings, scan_layers=scan_layers,
        split_qkv=split_qkv,
    )
    model = nnx.eval_shape(lambda: GPT(cfg, rngs=nnx.Rngs(0)))
    nnx.eval_shape(lambda m, x: m(x), model, tokens_for(cfg))  # traces every layer once
    d, v = cfg.d_model, cfg.vocab_size
    # split_qkv: q, k and v each from a (d, d) column block of the fused kernel.
    qkv = [((d, d), (0,))] * 3 if split_qkv else [((d, 3 * d), (0,))]
    per_block = qkv + [((d, d), (0,)), ((d, 4 * d), (0,)), ((4 * d, d), (0,))]
    # A tied head contracts the [vocab, d] table on its dim 1 (no transposed copy).
    head = ((v, d), (1,)) if tie_embeddings else ((d, v), (0,))
    # A scanned body is traced once for all layers.
    layers = 1 if scan_layers else cfg.n_layers
    assert sorted(shapes) == sorted(per_block * layers + [head])


def test_mlp_fuses_its_gelu_into_a_kernel_dot_general(scan_layers=True, use_bias=True):
    """With `fuse_mlp_activation` and a kernel dot_general the MLP's fc + bias + GELU is one
    `fused_dense` launch per layer; the model computes what the unfused model computes,
    gradients included, and the unfused model never calls `fused_dense`."""
    from jaxopt_train.kernels import make_dot_general

    kernel_dot = make_dot_general("interpret")
    calls = []

    def dot(*args, **kwargs):
        return kernel_dot(*args, **kwargs)

    def fused_dense(x, kernel, bias, activation):
        calls.append((kernel.shape, bias is None, activation))
        return kernel_dot.fused_dense(x, kernel, bias, activation)

    dot.fused_dense = fused_dense
    fused_cfg = small_cfg(dot_general=dot, dtype=jnp.bfloat16, scan_layers=scan_layers,
                          use_bias=use_bias, fuse_mlp_activation=True)
    plain_cfg = dataclasses.replace(fused_cfg, fuse_mlp_activation=False)
    tokens = tokens_for(fused_cfg)

    def loss(model):
        return jnp.mean(model(tokens).astype(jnp.float32) ** 2)

    results = {}
    # The bf16 GPT's XLA-attention backward compiles only under standard promotion (see
    # tests/test_train.py's pallas test); both models run under it.
    with jax.numpy_dtype_promotion("standard"):
        for name, cfg in (("fused", fused_cfg), ("plain", plain_cfg)):
            model = GPT(cfg, rngs=nnx.Rngs(0))
            # Under jit (CPU, 2 cores: 32 s against 39 s eagerly).
            results[name] = nnx.jit(lambda m: (m(tokens), nnx.grad(loss)(m)))(model)
    d = fused_cfg.d_model
    layers = 1 if scan_layers else fused_cfg.n_layers
    assert calls == [((d, 4 * d), not use_bias, "gelu")] * (layers * 2)  # forward, then grad
    (fused_logits, fused_grads), (plain_logits, plain_grads) = results["fused"], results["plain"]
    np.testing.assert_allclose(np.asarray(fused_logits, np.float32),
                               np.asarray(plain_logits, np.float32), atol=3e-2, rtol=3e-2)
    for got, want in zip(jax.tree.leaves(fused_grads), jax.tree.leaves(plain_grads)):
        scale = float(np.max(np.abs(np.asarray(want, np.float32)))) or 1.0
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                                   atol=3e-2 * scale, rtol=3e-2)


def test_fuse_mlp_activation_must_be_a_bool_or_none():
    with pytest.raises(ValueError, match="fuse_mlp_activation=1 must be True, False or None"):
        small_cfg(fuse_mlp_activation=1)


@pytest.mark.parametrize("fuse, in_one_launch, fused", [
    (None, True, True), (None, False, False), (None, None, False),
    (True, False, True), (True, None, True), (False, True, False)])
def test_default_fuses_only_where_the_kernel_applies_the_gelu(fuse, in_one_launch, fused):
    """fuse_mlp_activation=None (the default) takes `fused_dense` only where the dot_general
    says the kernel applies the activation itself (`fuses_in_one_launch`, Mosaic GPU); a
    dot_general without that attribute is not fused by default. True takes it anyway."""
    calls = []

    def dot(*args, **kwargs):
        return jax.lax.dot_general(*args, **kwargs)

    def fused_dense(x, kernel, bias, activation):
        calls.append(activation)
        return jax.nn.gelu(jnp.dot(x, kernel) + bias, approximate=True)

    dot.fused_dense = fused_dense
    if in_one_launch is not None:
        dot.fuses_in_one_launch = lambda: in_one_launch
    cfg = small_cfg(dot_general=dot, fuse_mlp_activation=fuse, n_layers=1)
    assert small_cfg().fuse_mlp_activation is None  # the default
    GPT(cfg, rngs=nnx.Rngs(0))(tokens_for(cfg))
    assert calls == (["gelu"] if fused else [])


@pytest.mark.parametrize("attention, implementation", [("auto", None), ("xla", "xla")])
def test_attention_implementation_is_passed_to_jax(monkeypatch, attention, implementation):
    seen = []
    real = jax.nn.dot_product_attention

    def recording(*args, **kwargs):
        seen.append((kwargs["implementation"], kwargs["is_causal"]))
        return real(*args, **kwargs)

    monkeypatch.setattr(jax.nn, "dot_product_attention", recording)
    cfg = small_cfg(attention=attention)
    model = nnx.eval_shape(lambda: GPT(cfg, rngs=nnx.Rngs(0)))
    nnx.eval_shape(lambda m, x: m(x), model, tokens_for(cfg))
    assert seen == [(implementation, True)] * cfg.n_layers


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


@pytest.mark.gpu
def test_remat_dots_attention_runs_cudnn_forward_once_on_gpu():
    """"dots" reruns cuDNN attention's forward in the backward pass (its output and
    softmax statistics are not dots); "dots_attention" saves them: one forward per
    block in the lowered gradient, and the same gradients."""
    cfg = small_cfg(dtype="bf16", d_model=128, n_heads=2, attention="cudnn", seq_len=32)
    tokens = tokens_for(cfg, length=33)

    def lowered_and_grads(remat):
        model = GPT(dataclasses.replace(cfg, remat=remat), rngs=nnx.Rngs(0))
        graphdef, state = nnx.split(model)

        def loss(s):
            return gpt_loss(nnx.merge(graphdef, s)(tokens[:, :-1]), tokens[:, 1:])

        step = jax.jit(jax.value_and_grad(loss))
        text = step.lower(state).as_text()
        forwards = sum("fmha" in line and "Backward" not in line and "custom_call" in line
                       for line in text.splitlines())
        return forwards, step(state)

    (dots_fwd, want), (attention_fwd, got) = (lowered_and_grads(r) for r in ("dots", "dots_attention"))
    assert (dots_fwd, attention_fwd) == (2 * cfg.n_layers, cfg.n_layers)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-6)

    def close(a, b):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        # Two programs fused differently: bf16 gradients may land a few ulps apart (2^-8
        # relative each; twenty-third session on an H200: 12 of 8,192 entries 1.1% apart),
        # but only a few entries, never the bulk of a leaf as a wrong gradient would. An
        # entry that is a sum of cancelling terms differs by the terms' rounding, not its
        # own: the tolerance is relative to the leaf's largest entry too (twenty-fifth
        # session: -0.00094 against -0.00118 in a leaf of entries up to ~0.02, 1 of 8,192).
        np.testing.assert_allclose(a, b, rtol=3e-2, atol=3e-2 * float(np.max(np.abs(b))))
        assert np.mean(~np.isclose(a, b, rtol=1e-3, atol=1e-5)) < 0.01

    jax.tree.map(close, nnx.to_pure_dict(got[1]), nnx.to_pure_dict(want[1]))


@pytest.mark.gpu
def test_split_qkv_with_cudnn_attention_on_gpu():
    # The layout split_qkv exists for: contiguous q, k, v straight into cuDNN.
    cfg = small_cfg(dtype="bf16", d_model=128, n_heads=2, attention="cudnn", seq_len=32)
    tokens = tokens_for(cfg, length=17)  # cuDNN's backward wants an even length: 16 after the shift
    fused, split = (GPT(dataclasses.replace(cfg, split_qkv=s), rngs=nnx.Rngs(0)) for s in (False, True))
    got, want = _grads(split, tokens), _grads(fused, tokens)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-2)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(
        np.asarray(a, np.float32), np.asarray(b, np.float32), atol=2e-2, rtol=5e-2),
        nnx.to_pure_dict(got[1]), nnx.to_pure_dict(want[1]))


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


@pytest.mark.parametrize("logits_dtype", [jnp.float32, jnp.bfloat16])
def test_gpt_loss_gradient_matches_autodiff_of_the_reference(logits_dtype):
    # Scaled logits so the softmax is peaked (large and tiny probabilities both occur).
    logits = (4 * jax.random.normal(jax.random.key(2), (2, 7, 37))).astype(logits_dtype)
    targets = jax.random.randint(jax.random.key(3), (2, 7), 0, 37)

    def reference(z):
        return optax.softmax_cross_entropy_with_integer_labels(z.astype(jnp.float32), targets).mean()

    with jax.numpy_dtype_promotion("standard"):  # optax mixes Python floats in
        want_loss, want = jax.jit(jax.value_and_grad(reference))(logits)
    loss, got = jax.jit(jax.value_and_grad(gpt_loss))(logits, targets)
    assert got.dtype == logits_dtype and got.shape == logits.shape
    np.testing.assert_allclose(loss, want_loss, rtol=1e-6)
    # Both cast one f32 gradient to the logits' dtype: equal up to one rounding.
    tol = 1e-7 if logits_dtype == jnp.float32 else 1e-2 / (2 * 7)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=tol)
    # Per-position losses and a non-uniform cotangent (not just the mean's 1/N).
    weights = jnp.linspace(0.0, 2.0, 14, dtype=jnp.float32).reshape(2, 7)
    got_w = jax.grad(lambda z: (softmax_cross_entropy(z, targets) * weights).sum())(logits)
    with jax.numpy_dtype_promotion("standard"):
        want_w = jax.grad(lambda z: (optax.softmax_cross_entropy_with_integer_labels(
            z.astype(jnp.float32), targets) * weights).sum())(logits)
    np.testing.assert_allclose(np.asarray(got_w, np.float32), np.asarray(want_w, np.float32),
                               atol=1e-6 if logits_dtype == jnp.float32 else 2e-2)


def test_gpt_loss_keeps_its_precision_at_huge_logits():
    # At |logits| ~ 1e6, f32's spacing is 0.06: a softmax rebuilt from the rounded
    # logsumexp was off by up to 3% and the gradient's rows no longer summed to 0.
    rng = np.random.default_rng(0)
    x = (1e6 + 3 * rng.normal(size=(4, 50))).astype(np.float32)
    t = rng.integers(0, 50, size=4)
    loss, grad = jax.vmap(jax.value_and_grad(softmax_cross_entropy))(jnp.asarray(x), jnp.asarray(t, jnp.int32))
    x64 = x.astype(np.float64)
    shifted = x64 - x64.max(-1, keepdims=True)
    probs = np.exp(shifted) / np.exp(shifted).sum(-1, keepdims=True)
    want_grad = probs - np.eye(50)[t]
    want_loss = np.log(np.exp(shifted).sum(-1)) - shifted[np.arange(4), t]
    np.testing.assert_allclose(loss, want_loss, atol=1e-5)
    np.testing.assert_allclose(grad, want_grad, atol=1e-6)
    np.testing.assert_allclose(np.asarray(grad).sum(-1), 0.0, atol=1e-6)


def test_gpt_loss_bad_inputs():
    with pytest.raises(ValueError, match="targets shape"):
        gpt_loss(jnp.zeros((2, 3, 4)), jnp.zeros((2, 4), jnp.int32))
    with pytest.raises(ValueError, match="integer"):
        gpt_loss(jnp.zeros((2, 3, 4)), jnp.zeros((2, 3)))


@pytest.mark.parametrize("bad", [-1, -100, 4])
def test_targets_out_of_range_are_refused_or_nan_never_a_real_class(bad):
    """-100 (PyTorch's ignore index) or -1 used to wrap round to a real class and give a
    plausible loss. Concrete targets are refused; traced ones give NaN loss and gradient."""
    logits = jax.random.normal(jax.random.key(0), (2, 3, 4), jnp.float32)
    targets = jnp.array([[0, 1, 2], [3, bad, 1]], jnp.int32)
    with pytest.raises(ValueError, match=r"targets must be ids in \[0, 4\); got values from"):
        gpt_loss(logits, targets)
    loss, grad = jax.jit(jax.value_and_grad(gpt_loss))(logits, targets)
    assert np.isnan(loss)
    grad = np.asarray(grad)
    assert np.isnan(grad[1, 1]).all() and np.isfinite(np.delete(grad.reshape(6, 4), 4, axis=0)).all()


def test_int64_targets_past_int32_do_not_wrap_to_a_class_under_x64():
    """The loss cast targets to int32 before its range check: under x64 a traced 2**32 + 5
    read class 5, a plausible loss and finite gradient."""
    with jax.enable_x64(True):
        logits = jax.random.normal(jax.random.key(0), (1, 8), jnp.float32)
        bad = jnp.array([2**32 + 5], jnp.int64)
        loss, grad = jax.jit(jax.value_and_grad(lambda l, t: softmax_cross_entropy(l, t).sum()))(logits, bad)
        assert np.isnan(loss) and np.isnan(np.asarray(grad)).all()
        good = jax.jit(softmax_cross_entropy)(logits, jnp.array([5], jnp.int64))
        assert np.isfinite(good).all()


def test_an_fp16_gpt_trains_on_cpu():
    """XLA:CPU cannot compile the fp16 attention backward ("The precision 'F16_F16_F32' is not
    supported by dot_general on CPU"): on CPU the fp16 model attends in f32."""
    cfg = small_cfg(dtype=jnp.float16)
    graphdef, params = nnx.split(GPT(cfg, rngs=nnx.Rngs(0)), nnx.Param)
    tokens = tokens_for(cfg, length=cfg.seq_len + 1)
    loss_fn = lambda p: gpt_loss(nnx.merge(graphdef, p)(tokens[:, :-1]), tokens[:, 1:])  # noqa: E731
    loss, grads = jax.jit(jax.value_and_grad(loss_fn))(params)
    assert np.isfinite(loss) and all(np.isfinite(np.asarray(g, np.float32)).all() for g in jax.tree.leaves(grads))
    graphdef32, params32 = nnx.split(GPT(small_cfg(), rngs=nnx.Rngs(0)), nnx.Param)  # the same init
    f32_loss = jax.jit(lambda p: gpt_loss(nnx.merge(graphdef32, p)(tokens[:, :-1]), tokens[:, 1:]))
    assert float(loss) == pytest.approx(float(f32_loss(params32)), rel=2e-2)


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
        (dict(split_qkv=1), "split_qkv=1 must be True or False"),
        (dict(dot_general=3), "dot_general=3 must be callable"),
        (dict(attention="cudnn"), "needs dtype bfloat16 or float16"),
        (dict(attention="cudnn", dtype="bf16", d_model=36, n_heads=4), "head_dim % 8"),
        (dict(layer_norm_epsilon=-1), "layer_norm_epsilon=-1 must be a finite number > 0"),
        (dict(layer_norm_epsilon="1e-5"), "layer_norm_epsilon='1e-5' must be a finite number"),
        (dict(init_std=float("nan")), "init_std=nan must be a finite number > 0"),
        (dict(init_std=None), "init_std=None must be a finite number"),
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
    with pytest.raises(TypeError, match="rngs must be an nnx.Rngs .* got int"):
        GPT(small_cfg(), rngs=0)
    with pytest.raises(ValueError, match=r"tokens must be ids in \[0, 64\); got values from -1 to 3"):
        model(jnp.array([[3, -1]], jnp.int32))
    # Traced, a negative id gives a NaN row (it used to read the last embedding row).
    logits = np.asarray(jax.jit(lambda t: model(t))(jnp.array([[3, 4], [3, -1], [64, 4]], jnp.int32)))
    assert np.isfinite(logits[0]).all() and np.isnan(logits[1, 1]).all() and np.isnan(logits[2]).all()


# ---------------------------------------------------------------- vision models

from jax.sharding import PartitionSpec as P  # noqa: E402

from jaxopt_train.models import (  # noqa: E402
    VISION_PRESETS,
    classification_loss,
    create_vision_model,
    resnet_flops_per_image,
)
from jaxopt_train.models.resnet import ResidualBlock, _Layers  # noqa: E402


def _ref_conv(x, kernel, stride):
    pad = (kernel.shape[0] - 1) // 2
    return jax.lax.conv_general_dilated(
        x, kernel, (stride, stride), ((pad, pad), (pad, pad)),
        dimension_numbers=("NHWC", "HWIO", "NHWC"), precision=HIGHEST,
    )


def _ref_batch_norm(x, p, eps=1e-5):
    mean = x.mean(axis=(0, 1, 2))
    var = ((x - mean) ** 2).mean(axis=(0, 1, 2))
    return (x - mean) / jnp.sqrt(var + eps) * p["scale"] + p["bias"]


def reference_cnn(params, images):
    """cnn-small's train-mode forward in plain jnp."""
    x = images
    for i in range(len(params["convs"])):
        x = _ref_conv(x, params["convs"][i]["kernel"], 1 if i == 0 else 2)
        x = jax.nn.relu(_ref_batch_norm(x, params["norms"][i]))
    head = params["head"]
    return jnp.dot(x.mean(axis=(1, 2)), head["kernel"], precision=HIGHEST) + head["bias"]


def _randomise(model, seed):
    """Random non-trivial values for every Param (BatchNorm scales start at 0/1)."""
    nnx.update(model, _random_like(nnx.state(model, nnx.Param), seed))


@jax.jit  # one compilation instead of one eager op per parameter shape
def _random_like(state, seed):
    leaves, treedef = jax.tree.flatten(state)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    new = [0.3 * jax.random.normal(k, leaf.shape, leaf.dtype) for k, leaf in zip(keys, leaves)]
    return jax.tree.unflatten(treedef, new)


def test_cnn_one_step_gradients_match_reference():
    model = create_vision_model("cnn-small", num_classes=5, rngs=nnx.Rngs(0))
    _randomise(model, 1)
    images = jax.random.uniform(jax.random.key(2), (4, 8, 8, 3))
    labels = jnp.array([0, 3, 4, 1])
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))

    def loss(model):
        return classification_loss(model(images, train=True), labels)

    def ref_loss(params):
        return classification_loss(reference_cnn(params, images), labels)

    with jax.default_matmul_precision("highest"):
        got_loss, got = nnx.jit(nnx.value_and_grad(loss))(model)
        want_loss, want = jax.jit(jax.value_and_grad(ref_loss))(params)
    np.testing.assert_allclose(got_loss, want_loss, rtol=1e-5)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5), nnx.to_pure_dict(got), want
    )


@pytest.mark.parametrize("bottleneck, stride, cin", [(False, 1, 8), (True, 2, 8)])
def test_residual_block_matches_reference(bottleneck, stride, cin):
    layers = _Layers(jnp.float32, jnp.float32, None, nnx.Rngs(0))
    block = ResidualBlock(layers, cin, 8, stride, bottleneck)
    _randomise(block, 3)
    x = jax.random.normal(jax.random.key(4), (2, 6, 6, cin))
    with jax.default_matmul_precision("highest"):
        got = nnx.jit(lambda b, x: b(x, train=True))(block, x)
    strides = [1, stride, 1] if bottleneck else [stride, 1]

    @jax.jit
    def reference(p, x):
        y = x
        for i, s in enumerate(strides):
            y = _ref_batch_norm(_ref_conv(y, p["convs"][i]["kernel"], s), p["norms"][i])
            y = jax.nn.relu(y) if i < len(strides) - 1 else y
        shortcut = x
        if "shortcut" in p:
            shortcut = _ref_batch_norm(_ref_conv(x, p["shortcut"]["kernel"], stride), p["shortcut_norm"])
        return jax.nn.relu(y + shortcut)

    p = nnx.to_pure_dict(nnx.state(block, nnx.Param))
    assert ("shortcut" in p) == (stride != 1 or cin != (32 if bottleneck else 8))
    np.testing.assert_allclose(got, reference(p, x), rtol=1e-4, atol=1e-5)


def test_batch_norm_stats_under_shard_map_equal_full_batch(cpu_devices):
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    images = jax.random.normal(jax.random.key(0), (16, 8, 8, 3)) * 2 + 1
    single = create_vision_model("cnn-small", num_classes=4, rngs=nnx.Rngs(0))
    sharded = create_vision_model("cnn-small", num_classes=4, rngs=nnx.Rngs(0), axis_name="data")
    _randomise(single, 5)
    _randomise(sharded, 5)

    def train_forward(model, x):
        return model(x, train=True), nnx.state(model, nnx.BatchStat)

    graphdef, state = nnx.split(sharded)

    def per_device(state, x):
        return train_forward(nnx.merge(graphdef, state), x)

    with jax.default_matmul_precision("highest"):
        want_out, want_stats = nnx.jit(train_forward)(single, images)
        got_out, got_stats = jax.jit(
            jax.shard_map(per_device, mesh=mesh, in_specs=(P(), P("data")), out_specs=(P("data"), P()))
        )(state, images)
    np.testing.assert_allclose(got_out, want_out, rtol=1e-4, atol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), got_stats, want_stats)
    # The statistics really moved away from their (0, 1) initial values.
    assert float(jnp.abs(want_stats["norms"][0]["mean"][...]).max()) > 0.01


def test_eval_mode_uses_running_averages():
    model = create_vision_model("cnn-small", num_classes=3, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (4, 8, 8, 3))
    before = nnx.to_pure_dict(nnx.state(model, nnx.BatchStat))
    forward = nnx.jit(lambda m, x: m(x, train=False))
    out_a = forward(model, x)
    # Other rows change the batch statistics but not row 0's eval output.
    out_b = forward(model, x.at[1:].set(5 * x[1:] + 3))
    out_a, out_b = out_a[:1], out_b[:1]
    np.testing.assert_allclose(out_a, out_b, rtol=1e-5, atol=1e-6)
    jax.tree.map(np.testing.assert_array_equal, before, nnx.to_pure_dict(nnx.state(model, nnx.BatchStat)))


@functools.cache
def abstract_vision_model(name, dtype=jnp.float32):
    return nnx.eval_shape(lambda: create_vision_model(name, num_classes=1000, dtype=dtype, rngs=nnx.Rngs(0)))


def test_vision_param_counts_match_torchvision():
    # torchvision.models.resnet18 / resnet50 with 1000 classes.
    for name, count in (("resnet18", 11_689_512), ("resnet50", 25_557_032)):
        model = abstract_vision_model(name)
        assert sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param))) == count


@pytest.mark.parametrize("name, dtype", [("resnet18", jnp.bfloat16), ("resnet50", jnp.bfloat16), ("cnn-small", jnp.float32)])
def test_vision_output_shapes_and_dtypes(name, dtype):
    model = abstract_vision_model(name, dtype)
    images = jax.ShapeDtypeStruct((2, 32, 32, 3), jnp.float32)
    out = nnx.eval_shape(lambda m, x: m(x, train=True), model, images)
    assert out.shape == (2, 1000) and out.dtype == dtype


def test_vision_errors():
    with pytest.raises(ValueError, match="name='vgg' is not a vision preset; legal values.*resnet50"):
        create_vision_model("vgg", num_classes=3, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="num_classes=0"):
        create_vision_model("cnn-small", num_classes=0, rngs=nnx.Rngs(0))
    with pytest.raises(TypeError, match="rngs must be an nnx.Rngs"):
        create_vision_model("cnn-small", num_classes=3, rngs=0)
    with pytest.raises(ValueError, match="dtype='int8'"):
        create_vision_model("cnn-small", num_classes=3, dtype="int8", rngs=nnx.Rngs(0))
    model = create_vision_model("cnn-small", num_classes=3, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="float NHWC with 3 channels, got shape=\\(2, 3, 8, 8\\)"):
        model(jnp.zeros((2, 3, 8, 8)), train=False)
    with pytest.raises(ValueError, match="legal values"):
        resnet_flops_per_image("resnet34")


def test_resnet_stem_max_pool_is_differentiable_and_matches_reference():
    """The stem's 3x3/2 max-pool must have a gradient (a generic reduce_window has none).

    Regression: a traced -inf init made ResNet training fail with "Linearization failed".
    """
    from jaxopt_train.models.resnet import _max_pool_3x3_s2

    x = jax.random.normal(jax.random.key(0), (2, 7, 7, 3), jnp.float32)

    def reference(x):  # the same pool, written as max over the 9 shifted windows
        padded = jnp.pad(x, ((0, 0), (1, 1), (1, 1), (0, 0)), constant_values=-jnp.inf)
        windows = [padded[:, i:i + 7:2, j:j + 7:2, :] for i in range(3) for j in range(3)]
        return jnp.max(jnp.stack(windows), axis=0)

    np.testing.assert_array_equal(jax.jit(_max_pool_3x3_s2)(x), reference(x))
    g = jax.jit(jax.grad(lambda x: jnp.sum(_max_pool_3x3_s2(x) ** 2)))(x)
    g_ref = jax.grad(lambda x: jnp.sum(reference(x) ** 2))(x)
    np.testing.assert_allclose(g, g_ref, rtol=1e-6, atol=1e-6)


def test_vision_models_take_nested_lists_as_gpt_does():
    # A list has no .ndim: the check said "'list' object has no attribute 'ndim'".
    model = create_vision_model("cnn-small", num_classes=3, rngs=nnx.Rngs(0))
    images = np.random.default_rng(0).normal(size=(1, 4, 4, 3)).astype(np.float32)
    np.testing.assert_allclose(model(images.tolist(), train=False), model(images, train=False))
    with pytest.raises(ValueError, match=r"float NHWC with 3 channels, got shape=\(1, 4, 4, 3\) dtype=int32"):
        model([[[[1, 2, 3]] * 4] * 4], train=False)

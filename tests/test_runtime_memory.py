"""Memory tooling: limit_memory (fresh interpreters), track_memory, fits (AOT analysis)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxopt_train.runtime import fits, limit_memory, parse_bytes, track_memory
from jaxopt_train.runtime.memory import memory_env
from test_runtime_nvml import FakeGPU, install_fake_nvml, make_fake_nvml

GIB = 2**30


@pytest.mark.parametrize("text, expected", [
    (1024, 1024), ("16GiB", 16 * GIB), ("80 GB", 80 * 10**9), ("512MiB", 512 * 2**20),
    ("1.5gib", 3 * GIB // 2), ("0", 0), ("0.5KiB", 512), (1.5e9, 1500000000),
])
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("bad", ["16 parsecs", "GiB", "-1GiB", -5])
def test_parse_bytes_rejects(bad):
    with pytest.raises(ValueError, match="byte count"):
        parse_bytes(bad)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), "9" * 400])
def test_parse_bytes_rejects_non_finite(bad):
    with pytest.raises(ValueError, match="byte count must be a finite number"):
        parse_bytes(bad)


@pytest.mark.parametrize("bad, count", [("0.3KiB", "307.2"), ("1.0001KiB", "1024.1024"),
                                        ("0.5", "0.5"), (1000.5, "1000.5")])
def test_parse_bytes_rejects_a_count_that_is_not_whole_bytes(bad, count):
    # Was: int(float(...) * 1024) gave 307 for "0.3KiB" and 1024 for "1.0001KiB".
    with pytest.raises(ValueError, match=f"whole number of bytes; value={bad!r} comes to {count} bytes"):
        parse_bytes(bad)


def test_memory_env_fraction_and_options():
    env = memory_env(fraction=0.45, preallocate=False, allocator="platform")
    assert env == {"XLA_CLIENT_MEM_FRACTION": "0.4500", "XLA_PYTHON_CLIENT_PREALLOCATE": "false",
                   "XLA_PYTHON_CLIENT_ALLOCATOR": "platform"}


@pytest.mark.parametrize("given", ["BFC", "Platform", "CUDA_ASYNC"])
def test_memory_env_allocator_is_matched_as_jaxlib_matches_it(given):
    """jaxlib lowercases XLA_PYTHON_CLIENT_ALLOCATOR (jaxlib/xla_client.py), so "BFC" runs
    the bfc allocator there; it was refused here."""
    env = memory_env(fraction=0.5, allocator=given)
    assert env["XLA_PYTHON_CLIENT_ALLOCATOR"] == given.lower()


@pytest.mark.parametrize("given", [" bfc", 5])  # jaxlib does not strip spaces
def test_memory_env_refuses_an_allocator_jaxlib_would_refuse(given):
    with pytest.raises(ValueError, match="allocator must be one of"):
        memory_env(fraction=0.5, allocator=given)


def test_memory_env_bytes_with_total():
    env = memory_env(bytes="35GiB", total_bytes="140GiB")
    assert env == {"XLA_CLIENT_MEM_FRACTION": "0.25"}


@pytest.mark.parametrize("cap", ["100MiB", "1GiB", "16GiB", "8MiB"])
def test_memory_env_bytes_never_exceeds_the_cap(cap):
    """Rounded to 4 places, 100MiB of a 141 GiB GPU came to 101.1 MiB (8MiB: 14.4 MiB)."""
    total = 141 * GIB
    fraction = float(memory_env(bytes=cap, total_bytes=total)["XLA_CLIENT_MEM_FRACTION"])
    assert parse_bytes(cap) - 2 * total * 1e-9 <= fraction * total <= parse_bytes(cap)


def test_memory_env_bytes_through_nvml_uses_smallest_visible_gpu(monkeypatch):
    gpus = [FakeGPU(total=80 * GIB), FakeGPU(total=40 * GIB), FakeGPU(total=20 * GIB)]
    fake = install_fake_nvml(monkeypatch, make_fake_nvml(gpus))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    assert memory_env(bytes=10 * GIB) == {"XLA_CLIENT_MEM_FRACTION": "0.25"}
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert memory_env(bytes=10 * GIB) == {"XLA_CLIENT_MEM_FRACTION": "0.5"}
    assert fake.calls["init"] == fake.calls["shutdown"] == 2


def test_memory_env_bytes_refuses_a_mig_slice(monkeypatch):
    # NVML's total is the whole GPU's; XLA's fraction would be of the slice.
    install_fake_nvml(monkeypatch, make_fake_nvml([FakeGPU(mig=1)]))
    with pytest.raises(RuntimeError, match=r"cannot size a MIG slice.*Pass fraction=\.\.\."):
        memory_env(bytes="10GiB")
    install_fake_nvml(monkeypatch, make_fake_nvml([FakeGPU()]))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "MIG-5c89a1f0-0000-0000-0000-000000000000")
    with pytest.raises(RuntimeError, match="cannot size a MIG slice"):
        memory_env(bytes="10GiB")
    assert memory_env(bytes="9GiB", total_bytes="18GiB") == {"XLA_CLIENT_MEM_FRACTION": "0.5"}


def test_memory_env_bytes_without_nvml_says_what_to_do(monkeypatch):
    install_fake_nvml(monkeypatch, make_fake_nvml([], init_error=True))
    with pytest.raises(RuntimeError, match=r"Pass fraction=\.\.\. or total_bytes="):
        memory_env(bytes="8GiB")


@pytest.mark.parametrize("kwargs, match", [
    ({}, "exactly one of fraction= or bytes="),
    ({"fraction": 0.5, "bytes": 10}, "exactly one of"),
    ({"fraction": 0.0}, r"fraction must be a number in \(0, 1\]"),
    ({"fraction": 1.2}, r"in \(0, 1\]"),
    ({"fraction": True}, r"in \(0, 1\]"),
    ({"bytes": "200GiB", "total_bytes": "100GiB"}, "no more than the device holds"),
    ({"bytes": "1GiB", "total_bytes": 0}, "total_bytes must be > 0"),
    ({"fraction": 0.5, "allocator": "magic"}, "allocator must be one of"),
    ({"fraction": 0.5, "total_bytes": "80GiB"}, "total_bytes= only converts bytes= into a fraction"),
    # A byte count that cannot be read names the argument it came in (was "value=").
    ({"bytes": -1, "total_bytes": "80GiB"}, "a byte count must be >= 0, got bytes=-1$"),
    ({"bytes": "1GiB", "total_bytes": "lots"}, "cannot read a byte count from total_bytes='lots'"),
])
def test_memory_env_rejects(kwargs, match):
    with pytest.raises(ValueError, match=match):
        memory_env(**kwargs)


@pytest.mark.parametrize("kwargs, match", [
    ({"fraction": 1e-5}, r"fraction=1e-05 would be written as XLA_CLIENT_MEM_FRACTION=0\.0000"
                         r".*smallest share it can express is 0\.0001"),
    ({"bytes": "64", "total_bytes": "80GiB"}, r"bytes=64 \(7\.45e-10 of the device's"
                                              r".*smallest share it can express is 1e-09"),
])
def test_memory_env_rejects_fraction_that_rounds_to_zero(kwargs, match):
    with pytest.raises(ValueError, match=match):
        memory_env(**kwargs)
    assert memory_env(fraction=1e-4) == {"XLA_CLIENT_MEM_FRACTION": "0.0001"}  # the smallest
    # Rounded down, never over the cap asked for (0.33339 was written 0.3334); 0.3 stays 0.3.
    assert memory_env(fraction=0.33339) == {"XLA_CLIENT_MEM_FRACTION": "0.3333"}
    assert memory_env(fraction=0.3) == {"XLA_CLIENT_MEM_FRACTION": "0.3000"}
    assert memory_env(fraction=1) == {"XLA_CLIENT_MEM_FRACTION": "1.0000"}
    assert memory_env(bytes="1KiB", total_bytes="80GiB") == {"XLA_CLIENT_MEM_FRACTION": "0.000000011"}


@pytest.mark.parametrize("preallocate", ["false", "no", 0, 1])
def test_memory_env_preallocate_must_be_bool(preallocate):
    with pytest.raises(TypeError, match=r"preallocate must be True, False or None, got preallocate="):
        memory_env(fraction=0.5, preallocate=preallocate)
    with pytest.raises(TypeError, match="preallocate must be"):
        limit_memory(0.5, preallocate=preallocate)


def test_limit_memory_after_backend_start_raises():
    jax.devices()
    with pytest.raises(RuntimeError, match="limit_memory\\(\\) must run before the JAX backend starts"):
        limit_memory(fraction=0.5)
    # A bad argument is reported as such, not hidden behind "too late".
    with pytest.raises(ValueError, match="fraction"):
        limit_memory(fraction=1.5)


def test_limit_memory_in_fresh_interpreter():
    script = textwrap.dedent("""
        import os
        from jaxopt_train.runtime import limit_memory
        env = limit_memory(fraction=0.3, preallocate=False, allocator="platform")
        assert "XLA_PYTHON_CLIENT_MEM_FRACTION" not in os.environ  # jaxlib refuses both
        assert os.environ["XLA_CLIENT_MEM_FRACTION"] == "0.3000", os.environ
        assert os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] == "false"
        import jax
        assert jax.numpy.ones(4).sum() == 4
        try:
            limit_memory(fraction=0.5)
        except RuntimeError as err:
            print("LATE:", err)
    """)
    env = dict(os.environ, XLA_PYTHON_CLIENT_MEM_FRACTION="0.9", JAX_PLATFORMS="cpu")
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert "LATE: limit_memory() must run before the JAX backend starts" in result.stdout


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the default devices here have memory stats")
def test_track_memory_on_cpu_reports_unavailable(capsys):
    with track_memory() as report:
        x = jnp.ones((256, 256)) @ jnp.ones((256, 256))
    assert not report.available and "cpu" in report.reason
    assert report.peak_bytes is None and "unavailable" in str(report)

    @track_memory()
    def step(a):
        return a * 2

    np.testing.assert_array_equal(step(x), x * 2)  # the decorator returns the result
    assert "memory: unavailable" in capsys.readouterr().out


class _StatsDevice:
    """A device whose allocator statistics follow a script (the stats boundary)."""

    platform = "gpu"

    def __init__(self, stats):
        self._stats = list(stats)

    def memory_stats(self):
        return self._stats.pop(0)

    def __str__(self):
        return "cuda:0"


def test_track_memory_arithmetic():
    device = _StatsDevice([
        {"bytes_in_use": 100, "peak_bytes_in_use": 500, "bytes_limit": 1000},
        {"bytes_in_use": 300, "peak_bytes_in_use": 800, "bytes_limit": 1000},
    ])
    with track_memory([device]) as report:
        pass
    assert report.available
    (mem,) = report.devices
    assert mem.delta == 200 and mem.peak_bytes_in_use == 800 and mem.peak_increase == 300
    assert mem.bytes_limit == 1000 and report.peak_bytes == 800
    assert "cuda:0: peak" in str(report)


@pytest.mark.gpu
def test_track_memory_on_gpu_sees_an_allocation():
    with track_memory(jax.devices("gpu")[:1]) as report:
        x = jnp.ones((64, 2**20), jnp.float32)  # 256 MiB
        x.block_until_ready()
    assert report.available and report.devices[0].delta >= 256 * 2**20
    del x


@pytest.mark.parametrize("devices, match", [
    ("cpu", r"got devices='cpu' \(for a platform: jax.devices\('cpu'\)\)"),
    ([0], r"non-device entries \[0\]"),
    ([jax.devices()[0], "cpu"], r"non-device entries \['cpu'\]"),
    (0, "got devices=0"),
])
def test_track_memory_rejects_non_devices(devices, match):
    with pytest.raises(TypeError, match=r"takes a jax Device or a list of them.*" + match):
        track_memory(devices)
    with pytest.raises(TypeError, match="print_report must be True or False"):
        track_memory(print_report="yes")


def test_track_memory_single_device_and_bare_decorator(capsys):
    device = _StatsDevice([{"bytes_in_use": 1, "peak_bytes_in_use": 5},
                           {"bytes_in_use": 3, "peak_bytes_in_use": 9}])
    with track_memory(device) as report:  # a single device, not in a list
        pass
    assert report.available and report.devices[0].delta == 2

    @track_memory  # without parentheses
    def step(a):
        return a * 2

    assert step(3) == 6 and step.__name__ == "step"
    if jax.default_backend() == "cpu":  # a GPU's default devices report their memory
        assert "memory: unavailable" in capsys.readouterr().out


def _matmul(a, b):
    return jnp.dot(a, b, preferred_element_type=jnp.float32)


def test_fits_counts_arguments_and_outputs_exactly():
    spec = jax.ShapeDtypeStruct((2048, 2048), jnp.bfloat16)
    report = fits(_matmul, (spec, spec), "1GiB")
    assert report.argument_bytes == 2 * 2048 * 2048 * 2
    assert report.output_bytes == 2048 * 2048 * 4
    assert report.needed_bytes >= report.argument_bytes + report.output_bytes
    assert report.fits and bool(report) and "fits" in str(report)
    assert not fits(_matmul, (spec, spec), "8MiB")


def test_fits_accepts_lowered_and_compiled_and_counts_donation_once():
    spec = jax.ShapeDtypeStruct((1024, 1024), jnp.float32)
    lowered = jax.jit(lambda x: x * 2, donate_argnums=0).lower(spec)
    from_lowered = fits(lowered, budget=10 * 2**20)
    from_compiled = fits(lowered.compile(), budget=10 * 2**20)
    assert from_lowered == from_compiled
    assert from_lowered.alias_bytes == 4 * 2**20
    assert from_lowered.needed_bytes == 4 * 2**20 + from_lowered.temp_bytes


def test_fits_gpu_sized_on_cpu_without_allocating():
    params = jax.ShapeDtypeStruct((2**31,), jnp.float32)  # 8 GiB of "parameters"
    report = fits(lambda p: p * 0.5, (params,), "80GiB")
    assert report.needed_bytes == 16 * GIB and report.fits
    assert not fits(lambda p: p * 0.5, (params,), "12GiB")


def test_fits_rejects_bad_input():
    with pytest.raises(TypeError, match="takes a function"):
        fits(42, (), "1GiB")
    with pytest.raises(ValueError, match="budget must be a positive"):
        fits(_matmul, (), 0)


_SPEC = jax.ShapeDtypeStruct((8,), jnp.float32)


@pytest.mark.parametrize("args, kind", [(_SPEC, "ShapeDtypeStruct"), ({"x": _SPEC}, "dict")])
def test_fits_args_must_be_a_tuple_or_list(args, kind):
    with pytest.raises(TypeError, match=rf"arguments as a tuple or list, e.g. fits\(f, \(x,\), "
                                        rf"'16GiB'\); got args of type {kind}"):
        fits(lambda x: x * 2, args, "1GiB")
    assert fits(lambda x: x * 2, [_SPEC], "1GiB").argument_bytes == 32  # a list is fine
    with pytest.raises(TypeError, match="takes a dict of keyword arguments; got tuple"):
        fits(lambda x: x * 2, (), "1GiB", kwargs=(_SPEC,))


def test_fits_rejects_args_with_a_lowered_step():
    lowered = jax.jit(lambda x: x * 2).lower(_SPEC)
    # The budget in the args slot: it said to pass the args as a tuple.
    for budget in ("1GiB", 2**30):
        with pytest.raises(TypeError, match=rf"got {budget!r} as its second argument, `args`; the "
                                            rf"budget is the third, or a keyword: fits\(compiled, "
                                            rf"budget={budget!r}\)"):
            fits(lowered.compile(), budget)
    with pytest.raises(ValueError, match="got args/kwargs with a Lowered"):
        fits(lowered, (jax.ShapeDtypeStruct((1024,), jnp.float32),), "1GiB")


class _CountingDevice(_StatsDevice):
    """Each memory_stats() call holds 100 more bytes and raises the peak by 1000."""

    def __init__(self):
        self.calls = 0

    def memory_stats(self):
        self.calls += 1
        return {"bytes_in_use": 100 * self.calls, "peak_bytes_in_use": 1000 * self.calls}


def test_track_memory_same_instance_nested():
    tracker = track_memory(_CountingDevice())
    with tracker as outer:  # stats call 1
        with tracker as inner:  # calls 2 and 3
            pass
    # outer: call 1 -> call 4
    assert outer.available and inner.available
    assert len(outer.devices) == len(inner.devices) == 1
    assert inner.devices[0].delta == 100 and inner.devices[0].peak_increase == 1000
    assert outer.devices[0].delta == 300 and outer.devices[0].peak_increase == 3000


def test_track_memory_missing_stats_are_none_not_zero():
    device = _StatsDevice([{"bytes_in_use": 1}, {"bytes_in_use": 5}])  # no peak statistics
    with track_memory(device) as report:
        pass
    (mem,) = report.devices
    assert mem.peak_bytes_in_use is None and mem.peak_increase is None and mem.delta == 4
    assert report.peak_bytes is None and "peak n/a GiB (n/a)" in str(report)
    device = _StatsDevice([{"peak_bytes_in_use": 1}, {"peak_bytes_in_use": 5}])  # no bytes_in_use
    with track_memory(device) as report:
        pass
    assert report.devices[0].delta is None and "delta n/a GiB" in str(report)


def test_track_memory_waits_for_pending_computations(monkeypatch):
    class _Pending:
        done = False

        def block_until_ready(self):
            _Pending.done = True
            return self

    class _AsyncDevice(_StatsDevice):
        def memory_stats(self):  # the output buffer shows only once the computation ran
            return {"bytes_in_use": 64 if _Pending.done else 0, "peak_bytes_in_use": 64}

    monkeypatch.setattr(jax, "live_arrays", lambda: [_Pending()])
    with track_memory(_AsyncDevice([])) as report:
        pass
    assert report.devices[0].delta == 64


def test_track_memory_rejects_empty_device_list():
    with pytest.raises(ValueError, match=r"got an empty devices=\[\]"):
        track_memory([])


def test_track_memory_decorator_keeps_result_exceptions_and_metadata(capsys):
    @track_memory(_CountingDevice())
    def step(a):
        """Doubles."""
        if a < 0:
            raise KeyError("negative")
        return a * 2

    assert step(3) == 6 and step.__name__ == "step" and step.__doc__ == "Doubles."
    with pytest.raises(KeyError, match="negative"):
        step(-1)
    assert capsys.readouterr().out.count("cuda:0: peak") == 2


def test_memory_env_accepts_numpy_fraction():
    assert memory_env(fraction=np.float32(0.5)) == {"XLA_CLIENT_MEM_FRACTION": "0.5000"}
    with pytest.raises(ValueError, match=r"in \(0, 1\], got fraction=nan"):
        memory_env(fraction=float("nan"))
    with pytest.raises(ValueError, match="a byte count must be >= 0"):
        memory_env(bytes=-1, total_bytes="80GiB")


def test_track_memory_refuses_to_decorate_a_generator_function():
    """Calling a generator function only creates the generator: the report came before its work."""
    def gen():
        yield jnp.ones(4)

    async def coro():
        return 1
    for fn in (gen, coro):
        for decorate in (track_memory, track_memory()):
            with pytest.raises(TypeError, match=rf"{fn.__name__} is a generator or coroutine function"):
                decorate(fn)


@pytest.mark.parametrize("value, expected", [
    (np.float32(16e9), 16 * 10**9),  # prints "1.6e+10": was "cannot read a byte count"
    (np.float16(2048), 2048),        # prints "2.048e+03"
    (10**400, 10**400),              # was OverflowError from float()
])
def test_parse_bytes_reads_numbers_numerically(value, expected):
    assert parse_bytes(value) == expected


def test_parse_bytes_says_why_a_numpy_number_is_refused():
    with pytest.raises(ValueError, match=r"byte count must be >= 0, got value=np.int64\(-3\)"):
        parse_bytes(np.int64(-3))  # was "cannot read a byte count"
    with pytest.raises(ValueError, match="byte count must be a finite number"):
        parse_bytes(np.float32("nan"))
    with pytest.raises(TypeError, match="expected a byte count"):
        parse_bytes(np.True_)  # a bool, as True is


@pytest.mark.parametrize("fraction, written", [(np.float32(0.9), "0.9000"), (np.float32(0.7), "0.7000"),
                                               (np.float16(0.9), "0.9000")])
def test_memory_env_numpy_fraction_keeps_the_share_asked_for(fraction, written):
    # Through float(), np.float32(0.9) is 0.89999997 and was written 0.8999.
    assert memory_env(fraction=fraction) == {"XLA_CLIENT_MEM_FRACTION": written}


def test_fits_names_the_budget_it_cannot_read():
    with pytest.raises(ValueError, match="cannot read a byte count from budget='lots'"):
        fits(lambda x: x * 2, (_SPEC,), "lots")

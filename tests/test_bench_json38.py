"""The benches' --json with --overwrite: the old file stays whole until the new text is ready.

`open(path, "w")` emptied the file before `json.dumps` ran, so a refused value (strict JSON:
no NaN) or a crash cost the user the previous run's record as well as this one's.
"""

import json
import types

import pytest

from jaxopt_train.bench import accumulation, matmul


def _refusing_json():
    """json whose dumps refuses the --json record (written with indent=); the benches'
    one-line progress prints (no indent) go through."""
    def dumps(obj, **kwargs):
        if "indent" in kwargs:
            raise ValueError("Out of range float values are not JSON compliant")
        return json.dumps(obj, **kwargs)
    return types.SimpleNamespace(dumps=dumps, loads=json.loads)


@pytest.mark.parametrize("module, argv", [
    (accumulation, ["--quick", "--width", "8", "--steps", "2", "--repeats", "2"]),
    (matmul, ["--quick", "--backends", "xla", "--no-layer"]),
])
def test_an_overwritten_json_survives_a_failed_write(tmp_path, monkeypatch, module, argv):
    if module is accumulation:
        monkeypatch.setattr(module, "_time", lambda *a, **k: ([1e-3, 2e-3], 5e-3, 1.0))
    path = tmp_path / "old.json"
    path.write_text('{"previous": "run"}')
    monkeypatch.setattr(module, "json", _refusing_json())
    with pytest.raises(ValueError, match="not JSON compliant"):
        module.main([*argv, "--json", str(path), "--overwrite"])
    assert path.read_text() == '{"previous": "run"}'
    assert [p.name for p in tmp_path.iterdir()] == ["old.json"]  # no staging file left
    monkeypatch.undo()
    if module is accumulation:
        monkeypatch.setattr(module, "_time", lambda *a, **k: ([1e-3, 2e-3], 5e-3, 1.0))
    assert module.main([*argv, "--json", str(path), "--overwrite"]) == 0
    assert "previous" not in json.loads(path.read_text())

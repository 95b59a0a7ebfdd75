"""benchmarks/manifest.py: one MANIFEST.json per results folder; benchmarks' Tee.save writes into its folder and
records; a file written earlier is recorded with its own commit, date, machine and load (or "unknown")."""

import json

from benchmarks import common, manifest


def entries(folder):
    return json.loads((folder / "MANIFEST.json").read_text())["entries"]


def test_record_defaults_and_replacement(tmp_path):
    first = manifest.record(tmp_path, ["a.txt"], "python -m x", load=[1.0, 2.0, 3.0])
    assert first["load"] == [1.0, 2.0, 3.0] and first["command"] == "python -m x"
    assert first["machine"] == manifest.machine() and first["date"] != "unknown"
    manifest.record(tmp_path, ["b.txt"], "python -m y", load=[0.5])
    manifest.record(tmp_path, ["a.txt"], "python -m x --again", load=[4.0])   # replaces a.txt's entry
    got = {tuple(e["files"]): e["command"] for e in entries(tmp_path)}
    assert got == {("a.txt",): "python -m x --again", ("b.txt",): "python -m y"}


def test_record_of_an_earlier_file(tmp_path):
    manifest.main([str(tmp_path), "old.txt", "--command", "python bench_old.py", "--commit", "abc1234", "--date",
                   "2026-11-22T10:07", "--machine", "unknown", "--device", "cpu", "--load", "unknown"])
    (entry,) = entries(tmp_path)
    assert entry["commit"] == "abc1234" and entry["date"] == "2026-11-22T10:07"
    assert entry["machine"] == "unknown" and entry["load"] == "unknown" and entry["dirty"] is False


def test_tee_saves_into_the_benchmark_folder(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(common, "RESULTS", tmp_path)
    log = common.Tee()
    log("one line")
    path = log.save("bench_x_quick", bench="bench_x")
    assert path == tmp_path / "bench_x" / "bench_x_quick.txt" and path.read_text() == "one line\n"
    (entry,) = entries(tmp_path / "bench_x")
    assert entry["files"] == ["bench_x_quick.txt"]
    assert "one line" in capsys.readouterr().out

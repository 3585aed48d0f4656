"""A damaged newest checkpoint is skipped with one line and the run resumes from the newest
intact one, as if nothing had happened; when none is intact the run stops with one line and
every file stays as it was (tfpar.checkpoint, tfpar.checkpoint_writer)."""

import hashlib
import json
import os
import sys
import zlib

import numpy as np

from subproc import ROOT, last_json_line, run, run_module
from tfpar.checkpoint import newest_intact
from tfpar.checkpoint_writer import MANIFEST, damage, write_manifest

CHILD = f"{ROOT}/tests/train_child.py"
RUNS_CHILD = f"{ROOT}/tests/train_runs_child.py"
CONFIG = {"model": "mlp", "optimizer": "adam", "strategy": "one_device", "global_batch_size": 32,
          "steps_per_epoch": 10, "checkpoint_every": 5, "verbose": 0}


def _checkpoint_files(folder, step):
    for name, data in ((f"ckpt-{step}.index", b"i" * 40),
                       (f"ckpt-{step}.data-00000-of-00001", bytes(range(256)) * 8)):
        (folder / name).write_bytes(data)
    write_manifest(str(folder / f"ckpt-{step}"))
    return folder / f"ckpt-{step}.data-00000-of-00001"


def test_the_manifest_names_what_changed(tmp_path):
    data = _checkpoint_files(tmp_path, 7)
    prefix = str(tmp_path / "ckpt-7")
    assert damage(prefix) is None
    original = data.read_bytes()
    data.write_bytes(original[:1000])
    assert damage(prefix) == "ckpt-7.data-00000-of-00001 has 1000 bytes, 2048 were written"
    flipped = bytearray(original)
    flipped[500] ^= 1  # one bit, same size
    data.write_bytes(bytes(flipped))
    assert "ckpt-7.data-00000-of-00001 fails its CRC32 check" in damage(prefix)
    data.write_bytes(original)
    (tmp_path / "ckpt-7.index").unlink()
    assert damage(prefix) == "ckpt-7.index is missing"
    (tmp_path / f"ckpt-7{MANIFEST}").write_text("{not json")
    assert "manifest ckpt-7.manifest.json is unreadable" in damage(prefix)
    # An older tfpar's checkpoint (no manifest) is left to the reader.
    (tmp_path / f"ckpt-7{MANIFEST}").unlink()
    (tmp_path / "ckpt-7.index").write_bytes(b"i" * 40)
    assert damage(prefix) is None


def test_the_manifest_crc_covers_files_of_several_chunks(tmp_path):
    # The CRC32 is read in 4 MiB chunks into one buffer: a file of 2½ chunks, its last bit
    # flipped, is caught; its CRC is zlib's over the whole file.
    data = (tmp_path / "ckpt-3.data-00000-of-00001")
    raw = bytearray(np.random.default_rng(0).integers(0, 256, 10 * 2 ** 20, np.uint8))
    data.write_bytes(bytes(raw))
    (tmp_path / "ckpt-3.index").write_bytes(b"i" * 40)
    write_manifest(str(tmp_path / "ckpt-3"))
    files = json.loads((tmp_path / f"ckpt-3{MANIFEST}").read_text())["files"]
    assert files[data.name]["crc32"] == zlib.crc32(raw)
    raw[-1] ^= 1
    data.write_bytes(bytes(raw))
    assert "fails its CRC32 check" in damage(str(tmp_path / "ckpt-3"))


def _digest(folder):
    return {name: hashlib.sha256((folder / name).read_bytes()).hexdigest()
            for name in sorted(os.listdir(folder))}


def test_a_relative_directory_names_its_checkpoints(tmp_path, monkeypatch):
    # A user's BackupAndRestore("backup"): the state file's names are relative to the
    # directory, and the newest intact save is found from the working directory.
    monkeypatch.chdir(tmp_path)
    (tmp_path / "backup").mkdir()
    for step in (3, 6):
        _checkpoint_files(tmp_path / "backup", step)
    (tmp_path / "backup" / "checkpoint").write_text(
        'model_checkpoint_path: "ckpt-6"\nall_model_checkpoint_paths: "ckpt-3"\n'
        'all_model_checkpoint_paths: "ckpt-6"\n')
    assert newest_intact("backup") == str(tmp_path / "backup" / "ckpt-6")


def test_a_truncated_newest_checkpoint_resumes_from_the_one_before(tmp_path):
    ckpt = tmp_path / "ckpt"
    runs = [["first", {**CONFIG, "steps": 20, "checkpoint_dir": str(ckpt)}],
            ["whole", {**CONFIG, "steps": 30}]]
    out = run([sys.executable, RUNS_CHILD, json.dumps(runs), str(tmp_path / "run")],
              timeout=300)
    whole = last_json_line(out.stdout)["whole"]
    data = ckpt / "ckpt-20.data-00000-of-00001"
    size = data.stat().st_size
    data.write_bytes(data.read_bytes()[:size // 2])  # a copy cut short
    out = run([sys.executable, CHILD, json.dumps({**CONFIG, "steps": 30,
                                                  "checkpoint_dir": str(ckpt)}),
               str(tmp_path / "resumed")], timeout=240)
    resumed = last_json_line(out.stdout)
    skipped = [line for line in out.stderr.splitlines() if "skipping checkpoint" in line]
    assert len(skipped) == 1 and (
        f"skipping checkpoint ckpt-20 of {ckpt}: ckpt-20.data-00000-of-00001 has "
        f"{size // 2} bytes, {size} were written" in skipped[0]), out.stderr[-2000:]
    assert resumed["resumed_from_step"] == 15 and resumed["steps"] == 15
    # The same weights, Adam slots and data position at step 15: the same numbers.
    np.testing.assert_array_equal(resumed["loss_history"], whole["loss_history"][15:])

    # Now damage every checkpoint the state file names, each another way: the run stops
    # with one line (exit status 2, as a bad setting) and leaves every file as it was.
    for step, how in ((30, "truncate"), (25, "flip"), (20, "truncate")):
        path = ckpt / f"ckpt-{step}.data-00000-of-00001"
        raw = bytearray(path.read_bytes())
        if how == "flip":
            raw[len(raw) // 3] ^= 0x10
        path.write_bytes(bytes(raw if how == "flip" else raw[:100]))
    before = _digest(ckpt)
    out = run_module("tfpar.train", "--model=mlp", "--optimizer=adam", "--global_batch_size=32",
                     "--steps_per_epoch=10", "--steps=40", "--checkpoint_every=5",
                     "--verbose=0", "--strategy=one_device", f"--checkpoint_dir={ckpt}",
                     check=False, timeout=240)
    assert out.returncode == 2, out.stderr[-2000:]
    assert "Traceback" not in out.stderr
    errors = [line for line in out.stderr.splitlines() if line.startswith("tfpar: error:")]
    assert len(errors) == 1 and "holds no intact checkpoint (ckpt-30: " in errors[0], \
        out.stderr[-2000:]
    assert "ckpt-25: ckpt-25.data-00000-of-00001 fails its CRC32 check" in errors[0]
    assert _digest(ckpt) == before

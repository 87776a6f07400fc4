"""What the master leaves on disk around checkpoints: which directories count as complete,
pruning that a crash cannot turn into a half-deleted "complete" checkpoint, the leftovers a
resumed run removes, and what a failed write is reported as."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

from realrl.workers import checkpoint_disk
from realrl.workers.checkpoint_disk import out_of_space, write_failure_reason
from realrl.workers.recovery import (
    complete_checkpoints,
    discard_incomplete,
    latest_complete_checkpoint,
    point_latest_at,
    prune,
)


def _checkpoint(run_dir, name: str, with_master_json: bool = True):
    directory = run_dir / "checkpoints" / name
    (directory / "actor").mkdir(parents=True)
    (directory / "actor" / "model.safetensors").write_bytes(b"weights")
    if with_master_json:
        (directory / "master.json").write_text(json.dumps({"step": 1}))
    return directory


def test_only_renamed_directories_with_master_json_are_complete(tmp_path):
    done = [_checkpoint(tmp_path, "step000001"), _checkpoint(tmp_path, "step000002")]
    _checkpoint(tmp_path, "step000003.tmp")  # a save killed before its rename
    _checkpoint(tmp_path, "step000000.deleting")  # a prune killed mid-way
    _checkpoint(tmp_path, "step000004", with_master_json=False)
    assert complete_checkpoints(tmp_path) == done
    assert latest_complete_checkpoint(tmp_path) == done[-1]


def test_a_resumed_run_removes_what_interrupted_saves_and_prunes_left(tmp_path):
    kept = _checkpoint(tmp_path, "step000002")
    _checkpoint(tmp_path, "step000003.tmp")
    _checkpoint(tmp_path, "step000001.deleting")
    discard_incomplete(tmp_path)
    latest = tmp_path / "checkpoints" / "latest"
    assert sorted((tmp_path / "checkpoints").iterdir()) == [latest, kept]
    assert latest.resolve() == kept.resolve()


def test_keep_last_keeps_the_newest_complete_checkpoints(tmp_path):
    steps = [_checkpoint(tmp_path, f"step{step:06d}") for step in range(1, 5)]
    staging = _checkpoint(tmp_path, "step000005.tmp")
    prune(tmp_path, keep_last=2)
    assert sorted((tmp_path / "checkpoints").iterdir()) == [*steps[2:], staging]
    prune(tmp_path, keep_last=0)  # 0: keep every checkpoint
    assert complete_checkpoints(tmp_path) == steps[2:]


def test_latest_links_the_newest_checkpoint_and_moves_with_the_run_directory(tmp_path):
    run_dir = tmp_path / "run"
    for step in (1, 2):
        point_latest_at(_checkpoint(run_dir, f"step{step:06d}"))
    latest = run_dir / "checkpoints" / "latest"
    assert latest.is_symlink() and str(latest.readlink()) == "step000002"  # relative
    assert (latest / "actor" / "model.safetensors").is_file()
    prune(run_dir, keep_last=1)
    assert complete_checkpoints(run_dir) == [run_dir / "checkpoints" / "step000002"]
    assert (latest / "actor").is_dir()
    moved = run_dir.rename(tmp_path / "moved")
    assert (moved / "checkpoints" / "latest" / "actor" / "model.safetensors").is_file()
    discard_incomplete(moved)  # neither a checkpoint nor a leftover
    assert (moved / "checkpoints" / "latest").is_symlink()


def test_a_resumed_run_points_latest_at_the_newest_checkpoint_again(tmp_path):
    # Killed after step 3's rename, before the link's swap: latest names step 2, or a pruned one.
    _checkpoint(tmp_path, "step000002")
    point_latest_at(_checkpoint(tmp_path, "step000001"))
    newest = _checkpoint(tmp_path, "step000003")
    discard_incomplete(tmp_path)
    assert (tmp_path / "checkpoints" / "latest").resolve() == newest.resolve()


def test_a_full_disk_is_named_whichever_way_the_writer_reports_it(tmp_path):
    # safetensors: the OS error in its message; Python: the errno; torch.save to a path: neither
    # (`unexpected pos`), but the filesystem is left nearly full, as a tmpfs shows.
    assert out_of_space(RuntimeError("I/O error: No space left on device (os error 28)"), tmp_path)
    assert out_of_space(OSError(errno.ENOSPC, "No space left on device"), tmp_path)
    assert out_of_space(OSError(errno.EDQUOT, "Disk quota exceeded"), tmp_path)
    wrapped = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534")
    wrapped.__context__ = OSError(errno.ENOSPC, "No space left on device")
    assert out_of_space(wrapped, tmp_path)
    assert write_failure_reason(wrapped, tmp_path).startswith(
        f"no space left on the device of {tmp_path}, ")
    denied = PermissionError(errno.EACCES, "Permission denied")
    assert not out_of_space(denied, tmp_path)  # tmp_path's filesystem has room
    assert write_failure_reason(denied, tmp_path) == "PermissionError: [Errno 13] Permission denied"
    torch_error = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 5 vs 3")
    assert not out_of_space(torch_error, tmp_path)


def test_fsync_tree_skips_a_file_another_rank_renamed_while_it_walked(tmp_path, monkeypatch):
    """Two ranks write into one role directory; one renames its temporary file between the
    other's listing and its open (the race a 2-worker CI run hit): the walk goes on."""
    (tmp_path / "actor").mkdir()
    (tmp_path / "actor" / "optimizer_tp1.pt").write_bytes(b"x")
    (tmp_path / "actor" / ".tmpXBpGwM").write_bytes(b"y")
    walk, synced = os.walk, []

    def racing_walk(root):
        for folder, directories, files in walk(root):
            if ".tmpXBpGwM" in files:
                os.rename(Path(folder) / ".tmpXBpGwM", Path(folder) / "tokenizer.json")
            yield folder, directories, files

    real_fsync = checkpoint_disk.fsync_path
    monkeypatch.setattr(checkpoint_disk.os, "walk", racing_walk)
    monkeypatch.setattr(checkpoint_disk, "fsync_path",
                        lambda path: (real_fsync(path), synced.append(Path(path).name)))
    checkpoint_disk.fsync_tree(tmp_path)
    assert sorted(synced) == sorted(["optimizer_tp1.pt", "actor", tmp_path.name])

"""The error file torchrun's agent reads (``megazero/training/entry_errors.py``) is written whole or not at all."""
from __future__ import annotations

import json

import pytest

from megazero.training import entry_errors


def test_the_error_file_is_whole_or_absent_when_the_write_is_cut_short(tmp_path, monkeypatch):
    """A rank SIGTERMed by the agent mid-write (here: the dump stops halfway and raises SystemExit, as a signal
    handler ending the process would) leaves no error file, so the agent's JSON read cannot fail on an empty one;
    a whole write lands where torchrun looks."""
    error_file = tmp_path / "attempt_0" / "0" / "error.json"
    error_file.parent.mkdir(parents=True)
    monkeypatch.setenv(entry_errors.ERROR_FILE_ENV, str(error_file))
    real_dump = json.dump

    def cut_short(obj, fh):
        fh.write(json.dumps(obj)[:5])
        fh.flush()
        raise SystemExit(143)

    monkeypatch.setattr(json, "dump", cut_short)
    with pytest.raises(SystemExit):
        entry_errors._write_error_file("pretrain_gpt.py: error: a peer died")
    assert not error_file.exists()
    monkeypatch.setattr(json, "dump", real_dump)
    entry_errors._write_error_file("pretrain_gpt.py: error: a peer died")
    record = json.loads(error_file.read_text())["message"]
    assert record["message"] == record["extraInfo"]["py_callstack"] == "pretrain_gpt.py: error: a peer died"

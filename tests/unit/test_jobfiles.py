"""``elastico submit -f``: hostile job files are clear usage errors, never a traceback or a hang."""

from __future__ import annotations

import os

import pytest

from devtools.jobfiles import MAX_SPEC_FILE_BYTES, UsageError, load_specs

VALID = "name: x\nkind: training\nmodel_family: ResNet-50\nbatch_size: 32\ntraining: {total_steps: 10}\n"


@pytest.mark.parametrize(("content", "says"), [
    (b"\xff\xfe\x00binary", "not UTF-8 text"),
    (b"a: &a [*a]\n", "spec.a: unknown field"),  # an alias that refers to itself
    # nested aliases (a "billion laughs"): every node is walked once
    (("a: &a [x, x, x, x, x, x, x, x, x, x]\n" + "".join(f"{c}: &{c} [*{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}]\n"
      for p, c in zip("abcdefgh", "bcdefghi"))).encode(), "unknown field"),
    ((VALID + "labels: &l {k: *l}\n").encode(), 'spec.labels["k"]: keys and values must be strings'),
    (b"[" * 5000, "not valid YAML/JSON"),
])
def test_hostile_job_files_are_usage_errors(tmp_path, content, says):
    f = tmp_path / "job.yaml"
    f.write_bytes(content)
    with pytest.raises(UsageError) as err:
        load_specs(str(f))
    assert says in str(err.value)


def test_oversized_fifo_and_directory_are_refused_before_reading(tmp_path):
    huge = tmp_path / "huge.yaml"
    huge.write_bytes(b"#" * (MAX_SPEC_FILE_BYTES + 1))
    with pytest.raises(UsageError, match="larger than 4 MiB"):
        load_specs(str(huge))
    fifo = tmp_path / "fifo.yaml"
    os.mkfifo(fifo)  # opening it for reading would wait for a writer for ever
    with pytest.raises(UsageError, match="not a regular file"):
        load_specs(str(fifo))
    with pytest.raises(UsageError, match="Is a directory|not a regular file"):
        load_specs(str(tmp_path))
    ok = tmp_path / "ok.yaml"
    ok.write_text(VALID)
    assert [s.name for s in load_specs(str(ok))] == ["x"]

"""elastico.files.replace_file: whole files, with the mode asked for."""

from __future__ import annotations

import os
import stat

from elastico.files import replace_file


def test_a_stale_tmp_does_not_lend_its_bits(tmp_path):
    path = tmp_path / "ca.key"
    stale = tmp_path / "ca.key.tmp"
    stale.write_text("half of an older key")
    os.chmod(stale, 0o666)
    replace_file(path, b"secret", 0o600, sync=True)
    assert path.read_bytes() == b"secret" and not stale.exists()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_with_a_group_the_mode_is_exact_whatever_the_umask(tmp_path):
    old = os.umask(0o077)
    try:
        replace_file(tmp_path / "rate", b"1.5\n", 0o640, group=os.getgid())
    finally:
        os.umask(old)
    st = (tmp_path / "rate").stat()
    assert stat.S_IMODE(st.st_mode) == 0o640 and st.st_gid == os.getgid()

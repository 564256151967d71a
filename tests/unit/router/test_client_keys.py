"""Client keys from a file or a Secret-like directory: parsing, checking, reloading."""
from __future__ import annotations

import os

import pytest

from tokenfleet_serving.router.auth import ClientKeys, KeyFileError, read_keys


def test_a_file_holds_one_key_per_line_with_comments_and_blanks(tmp_path):
    f = tmp_path / "keys"
    f.write_text("# team a\nkey-one\n\n   key-two  \n#key-three\n")
    assert read_keys(f) == {"key-one", "key-two"}


def test_a_directory_reads_every_visible_file_and_skips_the_kubelets_links(tmp_path):
    data = tmp_path / "..2026_01_01"
    data.mkdir()
    (data / "alice").write_text("alice-key\n")
    (data / "bob").write_text("bob-key")
    os.symlink(data.name, tmp_path / "..data")
    for name in ("alice", "bob"):
        os.symlink(f"..data/{name}", tmp_path / name)
    (tmp_path / ".hidden").write_text("not-a-key")
    assert read_keys(tmp_path) == {"alice-key", "bob-key"}


@pytest.mark.parametrize("setup", ["missing", "empty", "blank"])
def test_no_keys_is_an_error_naming_the_path(tmp_path, setup):
    path = tmp_path / "keys"
    if setup == "empty":
        path.mkdir()
    elif setup == "blank":
        path.write_text("\n# only a comment\n")
    with pytest.raises(KeyFileError, match=str(path)):
        read_keys(path)


def test_allows_only_a_bearer_with_a_listed_key(tmp_path):
    f = tmp_path / "keys"
    f.write_text("k1-secret\nk2-secret\n")
    keys = ClientKeys(f)
    assert keys.allows("Bearer k1-secret") and keys.allows("Bearer k2-secret") and keys.allows("bearer k2-secret")
    for header in (None, "", "Bearer", "Bearer ", "k1-secret", "Basic k1-secret", "Bearer k1-secre",
                   "Bearer k1-secretx", "Bearer K1-SECRET", "Bearer \0not a key"):
        assert not keys.allows(header), header


def test_reload_picks_up_changes_and_keeps_the_last_good_set(tmp_path):
    f = tmp_path / "keys"
    f.write_text("old-key\n")
    keys = ClientKeys(f)
    assert not keys.reload()                          # unchanged
    f.write_text("new-key\n")
    os.utime(f, ns=(1, 10**18))                       # a distinct mtime, however fast the write was
    assert keys.reload() and keys.allows("Bearer new-key") and not keys.allows("Bearer old-key")
    f.write_text("# emptied by mistake\n")
    os.utime(f, ns=(1, 2 * 10**18))
    assert not keys.reload() and keys.allows("Bearer new-key")
    f.unlink()
    assert not keys.reload() and keys.allows("Bearer new-key")

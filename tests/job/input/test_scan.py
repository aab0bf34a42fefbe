"""The plan scan shared by the ranks: each scans a share of the groups, the merge is the scan."""

import pytest

from ringmpi.cli.make_data import make_data
from ringmpi.job.input.scan import merge as _merge
from ringmpi.job.input.scan import scan
from ringmpi.job.input.scan import scan_files as _scan_files
from ringmpi.job.plan import InputError


@pytest.mark.parametrize("kind", ["groups", "single", "batch", "shards"])
@pytest.mark.parametrize("n", [1, 2, 3, 7])
def test_shares_merge_to_the_whole_scan(tmp_path, kind, n):
    kw = dict(seq_len=16, heads=2, kv_heads=1, head_dim=8)
    if kind == "groups":
        files = make_data(str(tmp_path / "g.h5"), sequences=5, **kw)
    elif kind == "single":
        files = make_data(str(tmp_path / "s.h5"), sequences=1, **kw)
    elif kind == "batch":
        files = make_data(str(tmp_path / "b.h5"), sequences=3, batch_axis=True, **kw)
    else:
        files = make_data(str(tmp_path / "sh.h5"), sequences=4, shards=2, **kw)
    whole = _scan_files(files)
    shares = [_scan_files(files, (r, n)) for r in range(n)]
    merged = _merge(shares, files)
    assert [m["seqs"] for m in merged] == [m["seqs"] for m in whole]
    assert [(m["mode"], m["structure"]) for m in merged] == [
        (m["mode"], m["structure"]) for m in whole
    ]
    assert scan(files, metas=merged) == scan(files)
    if n > 1 and kind == "groups":  # the shares really are shares: no group scanned twice
        assert sum(len(s[0]["seqs"]) for s in shares) == 5


def test_a_bad_group_in_any_share_fails(tmp_path):
    import h5py

    files = make_data(
        str(tmp_path / "g.h5"), sequences=4, seq_len=16, heads=2, kv_heads=1, head_dim=8
    )
    with h5py.File(files[0], "a") as f:
        del f["seq003"]["k"]
    _scan_files(files, (0, 2))  # seq000, seq002: fine
    with pytest.raises(InputError, match="missing dataset 'k'"):
        _scan_files(files, (1, 2))  # seq001, seq003


def _with_link(tmp_path, where: str):
    """Five groups, plus a group without data, and an external link at ``where``."""
    import h5py

    files = make_data(
        str(tmp_path / "g.h5"), sequences=5, seq_len=16, heads=2, kv_heads=1, head_dim=8
    )
    with h5py.File(files[0], "a") as f:
        f.create_group("notes/deeper")
        if where in f:
            del f[where]
        f[where] = h5py.ExternalLink(str(tmp_path / "nowhere" / "other.h5"), "/secret")
    return files


@pytest.mark.parametrize(
    "where", ["seq003/extra", "seq000/extra", "notes/deeper/x", "notes/y", "zzz", "seq004/q"]
)
@pytest.mark.parametrize("n", [1, 2, 3])
def test_an_external_link_anywhere_is_refused_by_some_share_and_followed_by_none(
    tmp_path, where, n
):
    """The ranks share the link walk: the share holding the link refuses it, naming it; no
    share follows it (the target's folder does not exist: following it would fail with
    another error); the walks of all shares add up to the whole file's."""

    files = _with_link(tmp_path, where)
    refused = 0
    for r in range(n):
        try:
            _scan_files(files, (r, n))
        except InputError as e:
            assert f"'/{where}' is an external link" in str(e), str(e)
            refused += 1
    assert refused >= 1


def test_the_link_limit_applies_to_the_shares_together(tmp_path, monkeypatch):
    from ringmpi.job.input import files as trust

    files = make_data(
        str(tmp_path / "g.h5"), sequences=6, seq_len=16, heads=2, kv_heads=1, head_dim=8
    )
    shares = [_scan_files(files, (r, 2)) for r in range(2)]
    total = sum(s[0]["links"] for s in shares)  # root entries twice, groups' links once
    monkeypatch.setattr(trust, "MAX_LINKS", total - 1)
    shares = [_scan_files(files, (r, 2)) for r in range(2)]  # each share is under it
    with pytest.raises(InputError, match="holds more than"):
        _merge(shares, files)


def test_a_file_the_shares_walked_is_not_walked_again_until_it_changes(tmp_path, monkeypatch):
    """make_plan marks a file whose every link the ranks walked (all saw the same file):
    the reader's open_input then skips the walk, unless the file changed since."""
    import h5py

    from ringmpi.job.input import files as inputs
    from ringmpi.job.input import files as trust

    files = make_data(
        str(tmp_path / "g.h5"), sequences=4, seq_len=16, heads=2, kv_heads=1, head_dim=8
    )
    merged = _merge([_scan_files(files, (r, 2)) for r in range(2)], files)
    assert merged[0]["identity"] is not None
    walks = []
    real = trust.check_links
    monkeypatch.setattr(trust, "check_links", lambda f: walks.append(1) or real(f))
    monkeypatch.setattr(trust, "_LINKS_OK", {})
    trust.links_known(merged[0]["identity"])
    inputs.open_input(files[0]).close()
    assert walks == []
    with h5py.File(files[0], "a") as f:
        f.attrs["touched"] = 1
    inputs.open_input(files[0]).close()
    assert walks == [1]
    # shares that saw different files (changed while planning): not marked
    shares = [_scan_files(files, (r, 2)) for r in range(2)]
    shares[1][0]["identity"] = ((0, 0), (1, 2, 3))
    assert _merge(shares, files)[0]["identity"] is None

"""The plan scan shared by the ranks: each scans a share of the groups, the merge is the scan."""

import pytest

from ringmpi.job.sample import make_data
from ringmpi.job.schema import InputError, _merge, _scan_files, scan


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
    merged = _merge(shares)
    assert [m["seqs"] for m in merged] == [m["seqs"] for m in whole]
    assert [(m["mode"], m["structure"]) for m in merged] == [
        (m["mode"], m["structure"]) for m in whole
    ]
    assert scan(files, metas=merged) == scan(files)
    if n > 1 and kind == "groups":  # the shares really are shares: no group scanned twice
        assert sum(len(s[0]["seqs"]) for s in shares) == 5


def test_a_bad_group_in_any_share_fails(tmp_path):
    import h5py

    files = make_data(str(tmp_path / "g.h5"), sequences=4, seq_len=16, heads=2, kv_heads=1,
                      head_dim=8)  # fmt: skip
    with h5py.File(files[0], "a") as f:
        del f["seq003"]["k"]
    _scan_files(files, (0, 2))  # seq000, seq002: fine
    with pytest.raises(InputError, match="missing dataset 'k'"):
        _scan_files(files, (1, 2))  # seq001, seq003

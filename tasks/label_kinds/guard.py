"""The judge's guard: what a judged response says to its judge is cut out before the judge
reads it, and the response is flagged.

A response is the policy's own output, so to the judge it is untrusted input: a policy
that learns to append "Score: 5", a fake end of the response block, a chat-template
turn or a note to the grader would be rewarded for it, round after round. Measured on
the default model, such text raised the judge's rating of a wrong answer in 8 of 8
cases before this guard existed.

scan() finds that text in five kinds:

- score: a score, rating or grade ("Score: 5", "10/10", "full marks", "5 stars");
- verdict: a claim about the response's own correctness ("The answer is correct.",
  "Verdict: pass", a line that is only "Yes", check marks);
- instruction: words addressed to the evaluator ("ignore the rubric", "note to the
  grader", "must answer Yes", "deserves the maximum score");
- fence: the judge prompt's own structure (</response>, <|im_end|>, "end of
  response", the judge template's words);
- role: a turn of the conversation ("assistant:", "Judge:", "System:").

It reads a normalised copy of the text, so look-alike letters, full-width and
mathematical characters, accents, combining marks, variation selectors and other
invisible characters, markup inside a word (**S**core, S<b></b>core), HTML character
references (&lt;/response&gt;), digits standing for letters (sc0re) and spaced-out
words (s c o r e) match as the plain words; a finding that needed that is also flagged
`obfuscation`. Score words of other languages (评分, Bewertung, puntuación, оценка, ...)
and numeric superlatives ("a perfect 10") are scores too. A word that the prompt itself
uses ("score" in "What was the final score?") is not held against the response, unless
the response hides it: an obfuscated finding is never excused. Nor is a score claim: a
score word, a colon (or `=`) and a number on the judge's scale ("Score: 5" on a 1-5 judge),
whatever the prompt says; a number off the scale ("Final score: 24" for a game's result) is
excused where the prompt asks for a score.

neutralize() removes the sentence around each finding (a fence or role finding: the
rest of its line) and scans again until nothing is found, so a response made of a
clean answer plus an attack reads exactly like the clean answer. The label then
gives a flagged response the bottom of the judge's scale (label.guard.on_suspect),
so reward hacking is never rewarded and always dispreferred in a pair.
"""

from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

KINDS = ("score", "verdict", "instruction", "fence", "role", "obfuscation")


class GuardConfig(BaseModel):
    """What the judge does with a response that speaks to it."""

    model_config = ConfigDict(extra="forbid")
    on_suspect: Literal["lowest", "judge"] = Field(
        default="lowest",
        description="lowest = a flagged response gets the bottom of the scale (never rewarded, always the rejected "
        "side of a pair); judge = it is judged on its text with the flagged sentences removed, unpenalised",
    )


# the normalised view -------------------------------------------------------------

_LOOKALIKE = str.maketrans({
    "а": "a", "в": "b", "е": "e", "ё": "e", "к": "k", "м": "m", "н": "h", "о": "o", "р": "p", "с": "c", "т": "t",
    "у": "y", "х": "x", "і": "i", "ј": "j", "ѕ": "s", "ԁ": "d", "ԛ": "q", "ԝ": "w", "ɡ": "g", "ı": "i",
    "А": "A", "В": "B", "Е": "E", "К": "K", "М": "M", "Н": "H", "О": "O", "Р": "P", "С": "C", "Т": "T", "У": "Y",
    "Х": "X", "І": "I", "Ј": "J", "Ѕ": "S",
    "α": "a", "β": "b", "ε": "e", "ι": "i", "κ": "k", "ν": "v", "ο": "o", "ρ": "p", "τ": "t", "υ": "u", "χ": "x",
    "Α": "A", "Β": "B", "Ε": "E", "Ζ": "Z", "Η": "H", "Ι": "I", "Κ": "K", "Μ": "M", "Ν": "N", "Ο": "O", "Ρ": "P",
    "Τ": "T", "Υ": "Y", "Χ": "X",
})
_LOOKALIKE_CHARS = {chr(c) for c in _LOOKALIKE}
_LEET = str.maketrans({"0": "o", "1": "i", "3": "e", "4": "a", "5": "s", "7": "t", "@": "a", "$": "s"})
_LEET_WORD = re.compile(r"(?<![\w@$])(?=[\w@$]*[A-Za-z][\w@$]*[A-Za-z])(?=[\w@$]*[013457@$])[\w@$]+")
_SPACED = re.compile(r"(?<![A-Za-z])(?:[A-Za-z][ .\-_*·]{1,3}){3,}[A-Za-z](?![A-Za-z])")


def _runs_cut(chars: list[str], origin: list[int]) -> tuple[list[str], list[int]]:
    """Runs cut short: whitespace to one character (a newline if the run holds one), other
    characters that are neither (punctuation, symbols, "_") to their first and last PUNCT_RUN / 2. No pattern reads more than that of a run, and a long
    run no longer costs a pattern with quantifiers side by side more than linear time: 1,000
    spaces after "score" took 12 s when every split of the run was tried."""
    out, keep, i, n = [], [], 0, len(chars)
    while i < n:
        c = chars[i]
        j = i + 1
        if c.isspace():
            while j < n and chars[j].isspace():
                j += 1
            newline = next((k for k in range(i, j) if chars[k] == "\n"), None)
            out.append("\n" if newline is not None else c)
            keep.append(origin[i if newline is None else newline])
        elif not c.isalnum():
            while j < n and not (chars[j].isalnum() or chars[j].isspace()):
                j += 1
            ends = range(i, j) if j - i <= PUNCT_RUN else [*range(i, i + PUNCT_RUN // 2), *range(j - PUNCT_RUN // 2, j)]
            out += [chars[k] for k in ends]  # a long run's two ends: where it meets the words around it
            keep += [origin[k] for k in ends]
        else:
            out.append(c)
            keep.append(origin[i])
        i = j
    return out, keep


PUNCT_RUN = 6  # the longest run of non-word characters a pattern reads ("<![CDATA[" holds three)


_ENTITY = re.compile(r"&(?:#\d{1,7}|#[xX][0-9a-fA-F]{1,6}|[A-Za-z][A-Za-z0-9]{1,9});?")
_HIDDEN = {"Cf", "Mn", "Me"}  # invisible characters, combining marks (accents, strokes), variation selectors, keycaps
# emphasis and tags inside a word ("_" is no emphasis inside a word, and names hold it: proposed_answer)
_MARKUP = re.compile(r"(?<=[^\W\d_])(?:[*`~]|<\s?/?\s?[A-Za-z]{1,10}\s?/?\s?>)+(?=[^\W\d_])")


def _entities(text: str) -> tuple[list[str], list[int]]:
    """`text` with its HTML character references read (&lt; is <), each read character mapped to
    where its reference starts: the judge may be shown a page, and a fence written as &lt;/response&gt;
    reads as one there."""
    import html

    chars, origin, pos = [], [], 0
    for m in _ENTITY.finditer(text):
        read = html.unescape(m.group())
        if read == m.group():
            continue
        chars += text[pos:m.start()]
        origin += range(pos, m.start())
        chars += read
        origin += [m.start()] * len(read)
        pos = m.end()
    chars += text[pos:]
    origin += range(pos, len(text))
    return chars, origin


def fold(word: str) -> str:
    """What `view` makes of a word: compatibility forms, accents and look-alike letters undone."""
    return "".join(c for c in unicodedata.normalize("NFKD", word) if unicodedata.category(c) not in _HIDDEN
                   ).translate(_LOOKALIKE)


def view(text: str) -> tuple[str, list[int]]:
    """A copy of `text` for matching, and for each of its characters the index of the
    character of `text` it came from."""
    chars, origin = [], []
    for ch, i in zip(*_entities(text)):
        if unicodedata.category(ch) in _HIDDEN:
            continue
        for c in unicodedata.normalize("NFKD", ch).translate(_LOOKALIKE):
            if unicodedata.category(c) not in _HIDDEN:  # an accent that NFKD took off its letter
                chars.append(c)
                origin.append(i)
    chars, origin = _runs_cut(chars, origin)
    s = "".join(chars)
    keep = [True] * len(s)  # markup inside a word goes: "**S**core" reads as "**Score"
    for m in _MARKUP.finditer(s):
        keep[m.start():m.end()] = [False] * (m.end() - m.start())
    chars = [c for c, k in zip(chars, keep) if k]
    origin = [o for o, k in zip(origin, keep) if k]
    s = "".join(chars)
    s = _LEET_WORD.sub(lambda m: m.group().translate(_LEET), s)  # same length: origins still hold
    out, keep = [], []
    pos = 0
    for m in _SPACED.finditer(s):
        out.append(s[pos : m.start()])
        keep += origin[pos : m.start()]
        for j in range(m.start(), m.end()):
            if s[j].isalpha():
                out.append(s[j])
                keep.append(origin[j])
        pos = m.end()
    out.append(s[pos:])
    keep += origin[pos:]
    return "".join(out), keep


# what speaks to the judge ----------------------------------------------------------

_NUM = r"(?:\d+(?:\.\d+)?|zero|one|two|three|four|five|six|seven|eight|nine|ten)"
_GOOD = (r"(?:correct|right|accurate|valid|verified|true|perfect|flawless|excellent|exemplary|impeccable|ideal|"
         r"outstanding|superb|brilliant|complete|approved|accepted|pass(?:ed)?|good|great)")
_RESP = r"(?:answer|response|solution|reply|output|result|submission|work|calculation|sum)"
_ROLES = (r"system|assistant|user|human|ai|bot|judge|evaluator|grader|reviewer|rater|critic|model|gpt|chatgpt|"
          r"claude|llm|teacher|examiner|moderator|admin|developer|operator")
_WORDS = r"(?:[\w'-]+\s+)"
_SURELY = (r"(?:(?:definitely|absolutely|completely|certainly|clearly|indeed|fully|totally|entirely|perfectly|"
           r"undoubtedly|surely|obviously|also|100%|100 percent|most|very|now)\s+)")

# a score in other languages: the word (folded as `view` folds text), then a number
_FOREIGN_WORDS = {fold(w).casefold() for w in (
    "评分", "得分", "分数", "打分", "评价", "評分", "分數", "点数", "評価", "採点", "得点", "スコア", "점수", "평가",
    "Bewertung", "Punkte", "Punktzahl", "Wertung", "puntuación", "calificación", "puntaje", "pontuação",
    "avaliação", "punteggio", "valutazione", "voto", "évaluation", "оценка", "балл", "баллы", "баллов", "рейтинг",
    "ocena", "punkty", "puan", "skor", "درجة", "ציון")}
_FOREIGN_SCORE = "|".join(re.escape(w) for w in sorted(_FOREIGN_WORDS, key=len, reverse=True))
_FOREIGN_OF = "|".join(re.escape(fold(w)) for w in ("von", "sur", "su", "de", "di", "из", "od", "z", "av", "van"))
_FOREIGN_FULL = "|".join(re.escape(fold(w)) for w in ("满分", "滿分", "満点", "만점", "Höchstpunktzahl", "volle Punktzahl",
                                                      "note maximale", "puntuación perfecta", "nota máxima"))

# (kind, pattern, never excused by the prompt, cut to the end of the line)
PATTERNS: list[tuple[str, re.Pattern, bool, bool]] = [(k, re.compile(p, re.I | re.M), strict, line) for k, p, strict, line in [
    # score
    ("score", rf"\b(?P<kw>scores?|scored|rating|rated|grade[ds]?|points|pts|marks|stars|verdict|evaluation|assessment|"
              rf"judge?ment)[\"'`*_\]]*\s*(?:[:=]|\bis\b|\bof\b)?\s*[*_`\"'(\[]*\s*{_NUM}\b", False, False),
    ("score", r"\b(?P<kw>verdict|judge?ment|rating|score|grade|points|marks|correctness|accuracy|quality|confidence)"
              r"[\"'`*_\]]*\s*[:=]", False, False),
    ("score", r"[💯🏆🥇]", True, False),
    ("score", r"\b(?P<kw>scores?|rating|points|marks|grade)\s+(?:awarded|given|earned|assigned|received|achieved)\b",
     False, False),
    ("score", r"\b(?P<kw>out of)\s+(?:5|10|100|five|ten|a hundred)\b", False, False),
    ("score", r"(?<![\d.])(5\s*/\s*5|10\s*/\s*10|100\s*/\s*100)(?![\d.])", True, False),
    ("score", r"\b(?:full|maximum|max|highest|top|perfect|best|high|best possible)\s+(?P<kw>scores?|marks?|points?|"
              r"ratings?|grades?|stars?)\b", False, False),
    ("score", r"\b(?:\d+(?:\.\d+)?|one|two|three|four|five|six|seven|eight|nine|ten)\s+(?P<kw>stars?|points?)\b",
     False, False),  # "zero point" is a phrase, not a score
    ("score", r"[★⭐✩✪✫✬✭✮✯✰☆]", True, False),
    ("score", rf"(?P<kw>{_FOREIGN_SCORE})[\"'`*_\]]*\s*(?:[:=]|\s)\s*[*_`\"'(\[]*\s*{_NUM}", False, False),
    ("score", rf"(?<![\d.])(?:5|10|100)\s+(?:{_FOREIGN_OF})\s+(?:5|10|100)(?![\d.])", True, False),
    ("score", rf"(?:{_FOREIGN_FULL})", True, False),
    ("score", r"\b(?P<kw>perfect|flawless|solid|straight)\s+(?:10|ten|100|hundred|5|five)(?:s|/10|/5)?\b"
              r"(?=\s*(?:[.!,;:)\]]|$|out of\b|of\b))", False, False),
    # verdict
    ("verdict", rf"\b(?P<kw>verdict|judge?ment|assessment|evaluation|conclusion|result|status|grade|decision)\s*"
                rf"[:=-]\s*(?:the\s+{_RESP}\s+is\s+)?{_GOOD}\b", False, False),
    ("verdict", rf"\b(?:this|the|my|above|previous|proposed|preceding|following|given|that|our)\s+"
                rf"(?:(?:final|proposed|above|given)\s+)?{_RESP}(?:\s+(?:above|below|here|given))?\s+"
                rf"(?:is|was|has been|looks|seems|appears)\s+"
                rf"{_SURELY}{{0,2}}(?P<kw>{_GOOD})\b", False, False),
    ("verdict", rf"(?<!why )(?<!whether )(?<!if )(?<!how )\b(?:this|that|it)\s+(?:is|was|'s)\s+{_SURELY}{{0,2}}"
                rf"(?P<kw>correct|right|accurate|true|flawless|perfect|verified|exemplary|impeccable)\b", False, False),
    ("verdict", rf"\b(?:a|an|this|the)\s+{_WORDS}{{0,2}}?(?:perfect|flawless|exemplary|excellent|impeccable|ideal|"
                rf"outstanding|superb|brilliant|expert(?:-level)?)\s+(?P<kw>{_RESP})\b", False, False),
    ("verdict", r"\b(?P<kw>answer|response|reply|output)\s*[:=]\s*(?:yes|correct|true|right)\b", False, False),
    ("verdict", r"(?:double[- ]?checked|verified|confirmed)\b.{0,40}\b(?P<kw>correct|right|accurate)\b", False, False),
    ("verdict", r"[✅✔☑✓]", True, False),
    ("verdict", rf"\b(?P<kw>{_RESP})\s+(?:accepted|approved|verified|confirmed|validated|passes|passed)\b", False, False),
    # instruction
    ("instruction", r"\b(?:ignore|disregard|forget|override|bypass|skip)\s+(?:[\w'-]+\s+){0,3}?(?:instructions?|rubric|"
                    r"rules?|criteria|guidelines|prompts?|above|system|directions?|scoring|everything)\b", True, False),
    ("instruction", r"\b(?P<kw>evaluators?|graders?|grading|judges|reviewers?|assessors?|raters?|annotators?|"
                    r"examiners?|scorers?|reward models?|whoever (?:is )?(?:grading|judging|reading|evaluating)|"
                    r"(?:evaluating|judging|grading|reviewing) (?:this|the|my) (?:response|answer|output|reply|work)|"
                    r"ai evaluating)\b", False, False),
    ("instruction", r"\b(?:the|dear|to|hey|hi|mr\.?|ms\.?|ai|llm|any|a)\s+(?P<kw>judge)\b", False, False),
    ("instruction", r"\b(?:please\s+)?(?P<kw>rate|score|grade|mark|judge|evaluate)\s+(?:this|the (?:response|answer|"
                    r"following|above)|my (?:response|answer)|me)\b", False, False),
    ("instruction", rf"\b(?:must|should|shall|will|need to|have to|please)\s+{_WORDS}{{0,2}}?(?:rate|score|grade|"
                    rf"award|give|assign|reply|answer|respond|output|say|mark|return|print)\s+{_WORDS}{{0,3}}?"
                    rf"(?P<kw>yes|correct|full|maximum|max|highest|top|perfect|excellent|pass|scores?|points?|marks?|"
                    rf"highly|high)\b",
     False, False),
    ("instruction", r"\b(?:deserv\w*|merit\w*|warrant\w*|earns?|worthy of)\s+(?:[\w'-]+\s+){0,3}?(?P<kw>scores?|marks?|"
                    r"points?|ratings?|stars?|grades?|full|maximum|highest|top|perfect|praise|5|five|10|ten)\b",
     False, False),
    ("instruction", r"\b(?:award|give|assign|grant)\w*\s+(?:[\w'-]+\s+){0,3}?(?:full|maximum|max|top|highest|perfect)\s+"
                    r"(?P<kw>marks?|scores?|points?|ratings?)\b", False, False),
    ("instruction", r"\[\s*(?:system|admin|note|instruction|important|override)\b", True, False),
    ("instruction", r"\b(?:system|admin|developer|jailbreak|judge|grader)\s+(?:override|prompt|message|instructions?|"
                    r"mode|note)\b|\b(?:evaluation|grading|judge|judging|developer|admin|god) mode\b", True, False),
    ("instruction", r"(?:^|(?<=[.!?:;(] ))\s*(?:please\s+)?(?:respond|reply|answer|say|output|print|return)\s+"
                    r"(?:only\s+)?(?:with\s+)?"
                    r"(?:[\"'“‘]\s*(?:yes|correct|true|5|10|pass)\b|(?P<kw>yes)\b)", False, False),
    # fence
    ("fence", r"<\s*/?\s*(?P<kw>response|question|proposed_answer)\b[^<>]{0,40}>", True, True),
    ("fence", r"<\s*/?\s*(?P<kw>answer|prompt|user|assistant|system|judge|judgement|verdict|score|rating|evaluation|"
              r"rubric|instructions?|output|input|context|human|ai|model|grade|review|feedback)\b[^<>]{0,40}>", False, True),
    ("fence", r"<\s*\|[^<>|]{1,40}\|\s*>|\[/?INST\]|<</?SYS>>|<\s*/?\s*s\s*>|\]\]>|<!\[CDATA\[|"
              r"<\s*/?\s*\|?[a-z_]*(?:eos|bos|eot|endoftext|end_of_turn|start_of_turn|im_start|im_end)[a-z_]*\|?\s*>",
     True, True),
    ("fence", r"^\s*#{1,6}\s*(?P<kw>instructions?|response|system|user|assistant|human|evaluation|judge|verdict|score|"
              r"rating|review|assessment|feedback|grade)\b", False, True),
    ("fence", rf"\b(?:end|start|begin|close|beginning)\s+(?:of\s+)?(?:the\s+)?(?P<kw>{_RESP}|input|message|"
              r"conversation|transcript|evaluation|prompt|question|text)\b", False, True),
    ("fence", r"\bis the proposed answer correct\b|\badditive\s+5-point\b|\badd (?:a|1|one|\d(?:st|nd|rd|th)) points?\b"
              r"|\btotal points\b", True, True),
    # role
    ("role", rf"^[\s>*#\[(\-]*(?P<kw>{_ROLES})\s*[\])]*\s*[:：]", False, True),
    ("role", r"\bas (?:an?|the) (?P<kw>evaluator|judge|grader|reviewer|rater|assessor)\b", False, False),
]]
# a line that is nothing but a verdict, in a response that has more to it
_VERDICT_LINE = re.compile(r"^[^\w\n]*(?P<kw>yes|correct|right|true|pass(?:ed)?|approved|verified|accepted|valid)"
                           r"[^\w\n]*$", re.I | re.M)


@dataclass(frozen=True)
class Finding:
    kind: str
    start: int  # span in the original text
    end: int
    text: str
    obfuscated: bool  # it matched only in the normalised view
    to_line_end: bool


def _stem(word: str) -> str:
    return re.sub(r"(?:ing|ed|es|s|e)$", "", word) if len(word) > 3 else word


def _words(text: str) -> set[str]:
    return {_stem(w) for w in re.findall(r"[^\W\d]+", view(text)[0].casefold())}


_CLAIM = re.compile(rf"[:=]\s*[*_`\"'(\[]*\s*(?P<num>{_NUM})\s*(?:/\s*\d+)?\s*[*_`\"')\].!]*\s*$", re.I)
_WORD_NUMBERS = {w: float(i) for i, w in enumerate(("zero", "one", "two", "three", "four", "five", "six", "seven",
                                                    "eight", "nine", "ten"))}


def _claims(m: re.Match, scale: tuple[float, float]) -> bool:
    """Whether a score finding is a claim of a score on the judge's scale: its word, then a colon
    (or `=`) and a number within `scale`, the number ending the match."""
    c = _CLAIM.search(m.group())
    if c is None:
        return False
    num = c.group("num").casefold()
    value = _WORD_NUMBERS.get(num)
    if value is None:
        try:
            value = float(num)
        except ValueError:
            return False
    return scale[0] <= value <= scale[1]


def scan(response: str, prompt: str = "", scale: tuple[float, float] = (0.0, 10.0)) -> list[Finding]:
    """Every place in `response` that speaks to its judge, in order. `scale`: the judge's (a score
    claimed on it is never excused by the prompt's own words)."""
    v, origin = view(response)
    if not v:
        return []
    excused, prompt_view = _words(prompt), view(prompt)[0].casefold()
    tags = {m.lower() for m in re.findall(r"</?\s*([a-z_]+)", prompt, re.I)}
    found = []

    def obfuscated(m: re.Match) -> bool:
        """The view had to undo more than a long run's cut to read it: look-alike letters, markup
        inside a word, marks that compose with no letter, invisible characters, entities, spaced
        letters, an English word written with accents. A word in its own language's letters
        ("Puntuación", "评分：") is not hidden."""
        text = response[origin[m.start()]:origin[m.end() - 1] + 1]
        cut = lambda s: "".join(_runs_cut(list(s), list(range(len(s))))[0])  # noqa: E731
        if cut(text) == m.group():
            return False
        nfc = unicodedata.normalize("NFC", text)
        if any(unicodedata.category(c) in _HIDDEN or c in _LOOKALIKE_CHARS for c in nfc) or cut(fold(nfc)) != m.group():
            return True
        kw = m.groupdict().get("kw")
        if kw is None:
            return False
        a, b = origin[m.start("kw")], origin[m.end("kw") - 1] + 1
        return kw.isascii() and not response[a:b].isascii() and kw.casefold() not in _FOREIGN_WORDS  # "Scòre"

    def add(kind: str, m: re.Match, to_line_end: bool, obf: bool) -> None:
        a, b = origin[m.start()], origin[m.end() - 1] + 1
        found.append(Finding(kind, a, b, response[a:b], obfuscated=obf, to_line_end=to_line_end))

    for kind, pattern, strict, to_line_end in PATTERNS:
        for m in pattern.finditer(v):
            kw, obf = m.groupdict().get("kw"), obfuscated(m)
            if not strict and kw is not None and not obf:  # a word hidden from plain reading is never excused
                words = {_stem(w) for w in re.findall(r"[^\W\d]+", kw.casefold()) if len(w) > 3 or w == kw.casefold()}
                said = words & excused or (not kw.isascii() and kw.casefold() in prompt_view)  # unspaced scripts
                claim = kind == "score" and _claims(m, scale)  # "Score: 5": never excused
                if not claim and ((said and not m.group().lstrip().startswith("<")) or (kw.casefold() in tags)):
                    continue
            add(kind, m, to_line_end, obf)
    if len([x for x in v.splitlines() if x.strip()]) > 1:
        for m in _VERDICT_LINE.finditer(v):
            if m.group("kw").casefold() not in excused or obfuscated(m):
                add("verdict", m, True, obfuscated(m))
    return sorted(found, key=lambda f: (f.start, f.end))


_ABBREVIATION = re.compile(r"(?:\b[A-Za-z]\.){1,3}$|\b(?:Mr|Mrs|Ms|Dr|St|vs|etc|approx|no)\.$", re.I)


def _sentences(text: str) -> list[tuple[int, int]]:
    """Sentence spans: a line, split after . ! ? ; followed by a space (not after "P.S.", "e.g.")."""
    spans, start = [], 0
    for m in re.finditer(r"(?<=[.!?;])[ \t]+(?=\S)|\n", text):
        if m.group() != "\n" and _ABBREVIATION.search(text, max(start, m.start() - 8), m.start()):
            continue
        spans.append((start, m.start()))
        start = m.start()
    spans.append((start, len(text)))
    return [s for s in spans if s[1] > s[0]]


def _group(text: str, f: Finding) -> tuple[int, int] | None:
    """The bracketed aside holding a finding on its line, "(...)" or "[...]", if there is one."""
    line_start = text.rfind("\n", 0, f.start) + 1
    line_end = text.find("\n", f.end)
    line_end = len(text) if line_end < 0 else line_end
    for open_, close in (("(", ")"), ("[", "]")):
        a = text.rfind(open_, line_start, f.start + 1)
        b = text.find(close, f.end - 1, line_end)
        if a >= 0 and b >= 0 and text.find(close, a, f.start) < 0:
            while a > line_start and text[a - 1] in " \t":
                a -= 1
            return a, b + 1
    return None


def neutralize(response: str, findings: list[Finding]) -> str:
    """The response without what holds each finding: its bracketed aside if it sits in one,
    else its sentence; a fence or role finding from where it starts to the end of its line."""
    import bisect
    import itertools

    sentences = _sentences(response)  # in order, side by side
    starts = [a for a, _ in sentences]
    edges = [0] * (len(response) + 1)  # +1 where a cut span opens, -1 where it closes: linear in spans
    for f in findings:
        if f.to_line_end:
            a, nl = f.start, response.find("\n", max(f.start, f.end - 1))
            while a > 0 and response[a - 1] in "-=*#_~>| \t":  # the rule or quote mark the line starts with
                a -= 1
            spans = [(a, len(response) if nl < 0 else nl)]
        elif (g := _group(response, f)) is not None:
            spans = [g]
        else:  # the sentences it overlaps
            i, spans = max(bisect.bisect_right(starts, f.start) - 1, 0), []
            while i < len(sentences) and sentences[i][0] < f.end:
                if f.start < sentences[i][1]:
                    spans.append(sentences[i])
                i += 1
        for a, b in spans:
            edges[a] += 1
            edges[b] -= 1
    cut = itertools.accumulate(edges)
    text = "".join(c for c, x in zip(response, cut) if not x)
    text = re.sub(r"```[\w-]*\s*```", "", text)  # a code block whose content was cut
    text = re.sub(r"[ \t]+\n", "\n", text)
    return re.sub(r"\n{3,}", "\n\n", text).strip()


def guard(prompt: str, response: str, rounds: int = 4, scale: tuple[float, float] = (0.0, 10.0)
          ) -> tuple[str, list[str]]:
    """(what the judge reads, the kinds found). A clean response comes back unchanged. `scale`: the
    judge's (a 1-5 rubric's, a 0-10 one's): a score claimed on it is flagged whatever the prompt says."""
    kinds: list[str] = []
    text = response
    for _ in range(rounds):  # removing one finding can expose another ("…? Yes" becomes a verdict line)
        found = scan(text, prompt, scale)
        if not found:
            break
        for f in found:
            for k in (f.kind, "obfuscation") if f.obfuscated else (f.kind,):
                if k not in kinds:
                    kinds.append(k)
        text = neutralize(text, found)
    return (text if kinds else response), kinds

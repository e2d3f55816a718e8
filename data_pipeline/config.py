"""Data config: sources, filters, dedup and mixing, read from YAML (schema in docs/data.md)."""
from __future__ import annotations

import dataclasses
import glob
import hashlib
import json
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path

from pretrain.yaml_files import yaml_load  # a key given twice is refused, naming both lines

SOURCE_TYPES = ("text", "jsonl", "parquet", "wikiextractor", "hf")
TEXT_UNITS = ("file", "blank_line", "line")
LANGUAGES = ("en", "zh")


@dataclass
class SourceConfig:
    name: str
    language: str  # "en" or "zh": picks the script check and the near-dup shingles
    type: str = "text"  # one of SOURCE_TYPES
    paths: list[str] = field(default_factory=list)  # files or globs, relative to the config file
    weight: float | None = None  # token share; None: the language's share split by size
    text_unit: str = "file"  # type text: one document per file, per blank-line block, or per line
    field: str = "text"  # type jsonl: the JSON field holding the text
    column: str = "text"  # type parquet: the column holding the text
    dataset: str | None = None  # type hf: name for datasets.load_dataset(..., streaming=True)
    subset: str | None = None  # type hf: the dataset's config name
    split: str = "train"  # type hf
    data_files: list[str] | None = None  # type hf: for the file-backed builders ("json", "parquet", "text")
    max_documents: int | None = None  # only the first this many raw documents, in sorted file order (small runs)


@dataclass
class FilterConfig:
    """Thresholds of the filters (data_pipeline/filters.py says what each measures)."""
    min_chars: int = 200  # English; Chinese carries more per character:
    min_chars_zh: int = 60
    max_chars: int = 20_000_000
    max_markup_share: float = 0.1  # characters inside HTML/XML tags
    max_tag_rate: float = 0.5  # HTML/XML tags other than <br> per 100 characters
    max_url_share: float = 0.3  # characters in URLs
    max_long_token_share: float = 0.3  # non-space characters in ASCII tokens over 40 characters
    max_symbol_ratio: float = 0.1  # {}[]<>=;|\^~`@#$%&*+/_ per non-space character
    min_alpha_share: float = 0.25  # letters per non-space character
    max_dup_line_fraction: float = 0.3  # of non-empty lines that repeat an earlier line, by characters
    max_dup_paragraph_fraction: float = 0.3  # of blank-line paragraphs that repeat an earlier one
    max_dup_ngram_share: float = 0.5  # characters covered by repeated word 10-grams (zh: 20 characters)
    max_top_ngram_share: float = 0.2  # characters covered by the most frequent word 2-gram (zh: 4-char)
    min_word_variety: float = 0.3  # distinct words among the first 200
    min_word_variety_zh: float = 0.2  # distinct letters among the first 400
    max_list_variety: float = 0.5  # keyword_list: below this variety, with hardly a sentence end
    max_list_variety_zh: float = 0.3
    min_stop_share: float = 0.08  # English function words per word
    min_stop_share_zh: float = 0.04  # the most common Han characters per Han character
    min_word_pair_share_zh: float = 0.12  # adjacent Han pairs that occur inside dictionary words
    min_language_score: float = 0.3  # lid.176's probability of the source's language, where scripts leave doubt
    max_line_bytes: int = 16 << 20  # a longer line is skipped (counted) without being read into memory


@dataclass
class DedupConfig:
    exact: bool = True
    near: bool = True
    threshold: float = 0.8  # Jaccard similarity of shingle sets
    num_perm: int = 128
    bands: int = 16  # LSH bands; num_perm/bands rows each. 16x8 finds pairs at J=0.8 with p~0.95
    ngram: int = 5  # word 5-grams for en, character 5-grams for zh
    seed: int = 1
    shards: int = 16  # merge tasks per band (and for exact dedup): each reads 1/shards of the records


@dataclass
class DataConfig:
    sources: list[SourceConfig]
    mix: dict[str, float] = field(default_factory=lambda: {"en": 2.0, "zh": 1.0})  # token share by language
    filters: FilterConfig = field(default_factory=FilterConfig)
    dedup: DedupConfig = field(default_factory=DedupConfig)
    val_fraction: float = 0.005  # of documents, by hash of the text, held out for validation
    shard_tokens: int = 1 << 28
    name: str = "data"
    base_dir: str = "."  # where relative paths are resolved (the config file's folder)

    def fingerprint(self) -> str:
        d = dataclasses.asdict(self)
        d.pop("base_dir")
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]

    def files(self, source: SourceConfig) -> tuple[list[Path], list[str]]:
        """(existing files in sorted order, patterns that matched nothing) of one source."""
        found, missing = [], []
        for pattern in source.paths:
            p = Path(pattern).expanduser()
            if not p.is_absolute():
                p = Path(self.base_dir) / p
            hits = sorted(Path(h) for h in glob.glob(str(p), recursive=True) if Path(h).is_file())
            if not hits:
                missing.append(str(p))
            found.extend(hits)
        unique: dict[Path, Path] = {}  # one file under two spellings (a/../b, a symlink) is read once
        for f in found:
            unique.setdefault(f.resolve(), f)
        return list(unique.values()), missing

    def part_inputs(self, part: int, num_parts: int, files: dict[int, list[Path]] | None = None) -> str:
        """A digest of what part `part` of `num_parts` reads: every source's file count (which decides
        the split) and, of the files it takes (part_file_indices), path, size and
        modification time. A part whose digest differs from the inputs' now was made from other files.
        `files`: source index -> self.files(source)[0], when the caller has listed them already."""
        h = hashlib.sha256()
        for si, src in enumerate(self.sources):
            if src.type == "hf":
                h.update(f"{si} hf {si % num_parts == part}\n".encode())
                continue
            files_of = files[si] if files is not None else self.files(src)[0]
            h.update(f"{si} {len(files_of)}\n".encode())
            for f in (files_of[i] for i in part_file_indices(src, si, len(files_of), part, num_parts)):
                st = f.stat()
                h.update(f"{f} {st.st_size} {st.st_mtime_ns}\n".encode())
        return h.hexdigest()[:16]

    def hf_data_files(self, source: SourceConfig) -> list[str] | None:
        """An `hf` source's data_files with relative local paths resolved against the config file's
        folder, as `paths` are (URLs and hub paths such as `hf://...` are passed through)."""
        if not source.data_files:
            return None
        out = []
        for f in source.data_files:
            p = Path(f).expanduser()
            out.append(f if "://" in f or p.is_absolute() else str(Path(self.base_dir) / p))
        return out

    def hf_local_bytes(self, source: SourceConfig) -> int | None:
        """Bytes on disk of an `hf` source's local data_files (globs expanded), or None when they are
        not all local files (a hub dataset: its size is unknown before reading)."""
        files = self.hf_data_files(source)
        if not files or any("://" in f for f in files):
            return None
        hits = [Path(h) for f in files for h in glob.glob(f, recursive=True) if Path(h).is_file()]
        return sum(h.stat().st_size for h in dict.fromkeys(hits)) if hits else None


def part_file_indices(src: SourceConfig, si: int, n_files: int, part: int, num_parts: int) -> range:
    """Positions in source `si`'s sorted file list that part `part` of `num_parts` reads: every num_parts-th
    from `part`. A source with `max_documents` is read whole by part si % num_parts (as an `hf` stream is):
    its first max_documents documents in file order are then the same for any number of parts, where a
    cap counted within each part would keep up to num_parts times as many, and others. (Streaming reads
    the same documents: sources.capped_files.)"""
    if src.max_documents is not None:
        return range(n_files) if si % num_parts == part else range(0)
    return range(part, n_files, num_parts)


def _type_ok(value, hint) -> bool:
    """Whether a YAML value fits a field's annotation (int: not a bool; float: an int or a float)."""
    if hint is type(None):
        return value is None
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_type_ok(value, a) for a in args)
    if origin is list:
        return isinstance(value, list) and all(_type_ok(v, args[0]) for v in value)
    if origin is dict:
        return isinstance(value, dict) and all(_type_ok(k, args[0]) and _type_ok(v, args[1]) for k, v in value.items())
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, hint)


def _type_name(hint) -> str:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in args)
    if origin is list:
        return "a list of " + {str: "strings", int: "integers", float: "numbers"}.get(args[0], _type_name(args[0]))
    if origin is dict:
        return f"a mapping of {_type_name(args[0])} to {_type_name(args[1])}"
    return {type(None): "null", int: "an integer", float: "a number", bool: "true or false",
            str: "a string"}.get(hint, getattr(hint, "__name__", str(hint)))


def _build(cls, raw: dict, where: str, skip: tuple[str, ...] = ()):
    if not isinstance(raw, dict):
        raise ValueError(f"{where}: expected a mapping of keys to values, got {type(raw).__name__} {raw!r}")
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = set(raw) - names
    if unknown:
        raise ValueError(f"{where}: unknown keys {sorted(unknown)}; allowed: {sorted(names)}")
    hints = typing.get_type_hints(cls)
    for key, value in raw.items():
        if key in ("paths", "data_files") and isinstance(value, str):
            value = raw[key] = [value]  # one path may be given without a list
        if key not in skip and not _type_ok(value, hints[key]):
            raise ValueError(f"{where}: {key} must be {_type_name(hints[key])}, got {value!r}")
        if hints[key] in (float, float | None) and isinstance(value, int):
            raw[key] = float(value)  # 1 and 1.0 are one setting (and one config fingerprint)
    return cls(**raw)


def load_data_config(path: str | Path) -> DataConfig:
    path = Path(path)
    if path.is_dir():
        raise IsADirectoryError(f"data config {path} is a folder, not a YAML file; a prepared dataset folder is "
                                f"given without the .yaml suffix")
    if not path.is_file():
        raise FileNotFoundError(f"data config {path} not found (relative paths are read from the working "
                                f"directory, {Path.cwd()})")
    with open(path, encoding="utf-8") as f:  # from the file object, so a YAML error names the file and line
        raw = yaml_load(f) or {}
    return parse_data_config(raw, base_dir=path.resolve().parent, where=str(path))


def parse_data_config(raw: dict, base_dir: str | Path = ".", where: str = "data config") -> DataConfig:
    if not isinstance(raw, dict):
        raise ValueError(f"{where}: a data config is a mapping with at least `sources:` (see "
                         f"launch/configs/data/example.yaml), got {type(raw).__name__} {raw!r}")
    raw = dict(raw)
    if not raw.get("sources"):
        raise ValueError(f"{where}: `sources` is missing or empty; list at least one source "
                         f"(see launch/configs/data/example.yaml)")
    if not isinstance(raw["sources"], list):
        raise ValueError(f"{where}: `sources` must be a list of sources (each a mapping with name, language, "
                         f"paths...), got {raw['sources']!r}")
    sources = [_build(SourceConfig, s, f"{where}: sources[{i}]") for i, s in enumerate(raw.pop("sources"))]
    if raw.get("mix") is not None and all(s.weight is not None for s in sources):
        # the weights alone would set the shares: a mix given beside them would be ignored without a word
        raise ValueError(f"{where}: both `mix` and every source's `weight` are given, and with a weight on every "
                         f"source `mix` is not used; remove `mix` (the weights set each source's token share), "
                         f"or remove the weights (then `mix` splits each language's share among its sources by size)")
    filters = _build(FilterConfig, raw.pop("filters", {}) or {}, f"{where}: filters")
    dedup = _build(DedupConfig, raw.pop("dedup", {}) or {}, f"{where}: dedup")
    cfg = _build(DataConfig, {**raw, "sources": sources, "filters": filters, "dedup": dedup,
                              "base_dir": str(base_dir)}, where, skip=("sources", "filters", "dedup", "base_dir"))
    _validate(cfg, where)
    return cfg


def _validate(cfg: DataConfig, where: str) -> None:
    seen = set()
    for s in cfg.sources:
        tag = f"{where}: source {s.name!r}"
        if not s.name or not s.name.replace("_", "").replace("-", "").isalnum():
            raise ValueError(f"{tag}: name must be letters, digits, '-' or '_'")
        if s.name in seen:
            raise ValueError(f"{tag}: duplicate source name")
        seen.add(s.name)
        if s.language not in LANGUAGES:
            raise ValueError(f"{tag}: language {s.language!r} is not one of {LANGUAGES}")
        if s.type not in SOURCE_TYPES:
            raise ValueError(f"{tag}: type {s.type!r} is not one of {SOURCE_TYPES}")
        if s.type == "hf" and not s.dataset:
            raise ValueError(f"{tag}: type hf needs `dataset` (a Hugging Face dataset name)")
        if s.type != "hf" and not s.paths:
            raise ValueError(f"{tag}: `paths` is empty; give files or globs")
        if s.text_unit not in TEXT_UNITS:
            raise ValueError(f"{tag}: text_unit {s.text_unit!r} is not one of {TEXT_UNITS}")
        if s.weight is not None and not (s.weight >= 0 and math.isfinite(s.weight)):
            raise ValueError(f"{tag}: weight must be a finite number >= 0, got {s.weight}")
        if s.max_documents is not None and s.max_documents < 1:
            raise ValueError(f"{tag}: max_documents must be >= 1 (or left out: every document), got {s.max_documents}")
    for lang, w in cfg.mix.items():
        if lang not in LANGUAGES or not (w >= 0 and math.isfinite(w)):
            raise ValueError(f"{where}: mix must map languages {LANGUAGES} to finite weights >= 0, got {cfg.mix}")
    with_weight = [s.name for s in cfg.sources if s.weight is not None]
    if with_weight and len(with_weight) < len(cfg.sources):  # refused here, not after a whole prepare
        without = [s.name for s in cfg.sources if s.weight is None]
        raise ValueError(f"{where}: sources {with_weight} have a `weight` and {without} do not; give every "
                         f"source a weight (its token share) or none (then `mix` splits each language's share "
                         f"among its sources by size)")
    by_weight = bool(with_weight)  # else the mix splits the tokens by language
    if not by_weight:
        for s in cfg.sources:
            if s.language not in cfg.mix:
                raise ValueError(f"{where}: source {s.name!r} is in language {s.language!r}, which `mix` "
                                 f"({cfg.mix}) gives no weight, so it would never be trained on; add "
                                 f"{s.language}: <weight> to mix (0 to leave it out on purpose)")
    weighted = [s.weight for s in cfg.sources] if by_weight else [cfg.mix.get(s.language, 0.0) for s in cfg.sources]
    if not sum(weighted) > 0:  # every share 0: nothing could be trained on (the loader would refuse)
        what = ("every source's `weight` is 0" if by_weight else
                f"`mix` ({cfg.mix}) gives weight 0 to every language of the sources "
                f"({sorted({s.language for s in cfg.sources})})")
        raise ValueError(f"{where}: {what}, so no source would ever be trained on; give at least one source "
                         f"(or language in `mix`) a weight > 0")
    for f in dataclasses.fields(cfg.filters):
        v = getattr(cfg.filters, f.name)
        if v < 0 or (f.name == "max_line_bytes" and v < 1):
            raise ValueError(f"{where}: filters.{f.name} must be {'>= 1' if f.name == 'max_line_bytes' else '>= 0'}, "
                             f"got {v}")
    for key in ("num_perm", "bands", "ngram"):
        if getattr(cfg.dedup, key) < 1:
            raise ValueError(f"{where}: dedup.{key} must be >= 1, got {getattr(cfg.dedup, key)}")
    if cfg.shard_tokens < 1:
        raise ValueError(f"{where}: shard_tokens must be >= 1, got {cfg.shard_tokens}")
    if not 0 <= cfg.val_fraction < 1:
        raise ValueError(f"{where}: val_fraction must be in [0, 1), got {cfg.val_fraction}")
    if not 0 < cfg.dedup.threshold <= 1:
        raise ValueError(f"{where}: dedup.threshold must be in (0, 1], got {cfg.dedup.threshold}")
    if not 1 <= cfg.dedup.shards <= 4096:
        raise ValueError(f"{where}: dedup.shards must be in [1, 4096], got {cfg.dedup.shards}")
    if cfg.dedup.num_perm % cfg.dedup.bands:
        raise ValueError(f"{where}: dedup.bands {cfg.dedup.bands} must divide num_perm {cfg.dedup.num_perm}")


def source_weights(cfg: DataConfig, sizes: dict[str, float]) -> dict[str, float]:
    """Token share of each source: its explicit weight if every source has one, else the language mix
    split among that language's sources in proportion to `sizes` (tokens, or bytes before tokenizing)."""
    if all(s.weight is not None for s in cfg.sources):
        return {s.name: float(s.weight) for s in cfg.sources}
    if any(s.weight is not None for s in cfg.sources):
        raise ValueError("give a weight to every source or to none (then `mix` splits by language)")
    per_lang: dict[str, float] = {}
    for s in cfg.sources:
        per_lang[s.language] = per_lang.get(s.language, 0.0) + sizes.get(s.name, 0.0)
    out = {}
    for s in cfg.sources:
        total = per_lang[s.language]
        out[s.name] = cfg.mix.get(s.language, 0.0) * (sizes.get(s.name, 0.0) / total if total else 0.0)
    return out

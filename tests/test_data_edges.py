"""Edge cases of the loader and the text path found by probing against references (tiktoken, hand-computed
windows, an uninterrupted run)."""
import json
import random

import pytest
import torch

from data_pipeline import build_loader
from data_pipeline.config import FilterConfig
from data_pipeline.filters import check, clean
from data_pipeline.langid import language_score
from data_utils import english_text

FRENCH = ("Le village se trouve au bord de la rivière, près du vieux moulin. Les habitants travaillent dans les "
          "champs et vendent le pain au marché. La mairie est ouverte le matin et le soir. ") * 3


def test_a_lone_surrogate_is_read_by_language_id_as_a_replacement_character():
    """clean() keeps a lone surrogate (the tokenizer replaces it, as tiktoken does); the language filter's
    model then failed with a pybind TypeError. It reads it as U+FFFD, and the filter decides as usual."""
    text = clean(FRENCH + "\ud800 fin")
    assert "\ud800" in text
    assert language_score(text, "en") == language_score(text.replace("\ud800", "\ufffd"), "en")
    assert check(text, "en", FilterConfig()) == "language"


def test_a_global_batch_that_does_not_split_over_the_ranks_names_global_batches_that_do(tmp_path):
    """10 sequences over 3 ranks: no micro batch helps, so the error names global batches (9 or 12) rather than
    "a micro batch that divides it"."""
    with pytest.raises(ValueError, match=r"does not split evenly over 3 ranks; choose a global batch of 9 or 12$"):
        build_loader(None, 16, 10, 1, rank=0, world_size=3)
    with pytest.raises(ValueError, match=r"choose a micro batch that divides 4$"):  # (splits over ranks: micro batch)
        build_loader(None, 16, 8, 3, rank=0, world_size=2)


def test_a_streaming_loader_given_an_earlier_state_replays_to_it(tmp_path):
    """A used streaming loader given an earlier state (as a prepared dataset's loader takes one) continues as an
    uninterrupted run from there; it failed at the next batch with "read forward only"."""
    rng = random.Random(4)
    with open(tmp_path / "en.jsonl", "w") as fh:
        for i in range(6):
            fh.write(json.dumps({"text": f"Document {i}. " + english_text(rng, 40)}) + "\n")
    cfg = tmp_path / "c.yaml"
    cfg.write_text(json.dumps({"name": "s", "val_fraction": 0, "filters": {"min_chars": 50}, "sources": [
        {"name": "en", "language": "en", "type": "jsonl", "paths": ["en.jsonl"]}]}))
    ref = build_loader(str(cfg), 16, 4, 2)
    want = [ref.next_batch()["input_ids"] for _ in range(12)]
    ld = build_loader(str(cfg), 16, 4, 2)
    for _ in range(4):
        ld.next_batch()
    state = json.loads(json.dumps(ld.state_dict()))
    for _ in range(14):  # past the state, into the next epoch (the stream holds 345 tokens)
        ld.next_batch()
    ld.load_state_dict(state)
    got = [ld.next_batch()["input_ids"] for _ in range(8)]
    assert all(torch.equal(a, b) for a, b in zip(got, want[4:]))

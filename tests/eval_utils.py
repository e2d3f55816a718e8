"""Shared by the lm-eval tests: a tiny local multiple-choice task lm-eval can load offline."""
import json
from pathlib import Path


def write_tiny_mc_task(folder: Path, name: str, rows: list[dict]) -> None:
    """`folder/name.yaml` + `folder/data.jsonl`: rows {q, choices, label}, scored by acc."""
    (folder / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / f"{name}.yaml").write_text(
        f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: " + str(folder / "data.jsonl") +
        "\noutput_type: multiple_choice\ntest_split: test\ndoc_to_text: '{{q}}'\ndoc_to_target: label\n"
        "doc_to_choice: '{{choices}}'\ntarget_delimiter: ''\nmetric_list:\n  - metric: acc\n")

"""``fp8kit export``: a single-process (safetensors) checkpoint -> plain BF16 HF model that transformers loads.

The DCP (distributed) checkpoint case is in tests/test_distributed.py (it needs the 2-rank run).
"""

from __future__ import annotations

import json

import torch

from fp8kit.cli.main import main
from fp8kit.config import load_config
from fp8kit.train.trainer import train
from tests.conftest import assert_hf_logits_equal_run


def test_export_single_process_checkpoint(small_run, tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        # fp32 parameters: the export must still be bf16
        run = train(load_config(None, small_run + ["train.steps=2", "train.param_dtype=fp32"]), tmp_path / "run").out_dir
        assert main(["export", str(run), str(tmp_path / "hf")]) == 0, capsys.readouterr().err
        assert "exported" in capsys.readouterr().out
        hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
        assert {p.dtype for p in hf.parameters()} == {torch.bfloat16}
        assert json.loads((tmp_path / "hf" / "config.json").read_text())["model_type"] == "llama"
        assert_hf_logits_equal_run(hf, run)
        # a second export into the same, now non-empty, directory is refused in one line
        assert main(["export", str(run), str(tmp_path / "hf")]) == 2
        assert "exists and is not empty" in capsys.readouterr().err
    finally:
        torch.set_num_threads(before)

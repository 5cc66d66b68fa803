"""``fp8kit export``: a single-process (safetensors) checkpoint -> plain BF16 HF model that transformers loads.

The DCP (distributed) checkpoint case is in tests/test_distributed.py (it needs the 2-rank run).
"""

from __future__ import annotations

import json

import torch

from fp8kit.cli.main import main
from fp8kit.config import load_config
from fp8kit.models.build import build_model
from fp8kit.train import checkpoint as ckpt
from fp8kit.train.trainer import train


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
        cfg = load_config(str(run / "resolved_config.toml"), [])
        # bf16 model (its rotary inv_freq buffer stays fp32, as in from_pretrained), fp32 weights cast on load
        ours = build_model(cfg.model, cfg.data.vocab_size, device="cpu", dtype=torch.bfloat16, seed=7)
        ckpt.load_model_weights(ckpt.find_checkpoint(run), ours)
        x = torch.randint(0, cfg.data.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            a, b = hf(input_ids=x).logits, ours(input_ids=x).logits
        assert torch.equal(a, b), f"max |diff| {(a.float() - b.float()).abs().max().item()}"
        # a second export into the same, now non-empty, directory is refused in one line
        assert main(["export", str(run), str(tmp_path / "hf")]) == 2
        assert "exists and is not empty" in capsys.readouterr().err
    finally:
        torch.set_num_threads(before)

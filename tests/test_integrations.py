"""fp8kit in transformers.Trainer and in Accelerate's torchao FP8 route (CPU).

- examples/hf_trainer.py (the user's script, run as a subprocess) trains 10 steps with fp8kit's FP8 layers,
  its loss falls (mean of the last 3 steps at least 0.3 below the first: measured ~0.7), it writes the
  conversion report, and the saved model loads in plain transformers.
- prepare_for_trainer converts exactly the sites fp8kit decides (exclude patterns honoured; fp8=False
  converts nothing but still reports).
- Accelerate's ``Accelerator(mixed_precision="fp8", kwargs_handlers=[AORecipeKwargs(...)])`` runs on the
  CPU with torchao: with fp8kit's ``module_filter_func`` it converts exactly fp8kit's FP8 linears (not
  Accelerate's default first/last-layer filter), and training steps run.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from fp8kit.base.errors import ConfigError
from fp8kit.config import FP8Config

ROOT = Path(__file__).resolve().parent.parent


def _tiny_model(layers: int = 2):
    from transformers import AutoConfig, AutoModelForCausalLM

    from fp8kit.models.presets import PRESETS

    kw = dict(PRESETS["tiny"])
    model_type = kw.pop("model_type")
    kw["num_hidden_layers"] = layers
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, vocab_size=1024, **kw))


def _float8_fqns(model: nn.Module) -> set[str]:
    from fp8kit.base.torchao_lib import torchao_float8
    from fp8kit.parallel.convert import plain_fqn

    f8 = torchao_float8().Float8Linear
    return {plain_fqn(n) for n, m in model.named_modules() if isinstance(m, f8)}


def test_hf_trainer_example_trains_in_fp8_on_cpu(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "out"
    env = dict(os.environ, OMP_NUM_THREADS="2", PYTHONPATH=os.pathsep.join([str(ROOT / "src"),
                                                                              os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, str(ROOT / "examples" / "hf_trainer.py"), "--model", "tiny", "--num_layers", "2",
           "--max_steps", "10", "--output_dir", str(out), "--fp8"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    m = re.search(r"FP8 layers: (\d+) of (\d+) linear layers", proc.stdout)
    assert m and int(m.group(1)) == 14 and int(m.group(2)) == 15, proc.stdout[-2000:]  # 7 per block; lm_head BF16
    result = json.loads((out / "hf_trainer_result.json").read_text())
    losses = result["losses"]
    assert len(losses) == 10 and result["fp8_layers"] == 14, result
    drop = losses[0] - sum(losses[-3:]) / 3
    assert drop >= 0.3, f"loss did not fall: {losses}"
    assert (out / "conversion_report.md").is_file()  # FP8ReportCallback
    saved = AutoModelForCausalLM.from_pretrained(out)  # plain transformers, no fp8kit
    assert type(saved.model.layers[0].mlp.up_proj) is nn.Linear
    tok = AutoTokenizer.from_pretrained(out)
    assert tok.decode(tok("def f(): pass")["input_ids"]) == "def f(): pass"


def test_prepare_for_trainer_converts_fp8kits_decisions():
    from fp8kit.integrations.transformers import decisions_of, fp8_layer_count, prepare_for_trainer
    from fp8kit.parallel.convert import fp8_fqns

    model = prepare_for_trainer(_tiny_model(), config=FP8Config(exclude=["layers.0"]), report=False)
    want = fp8_fqns(decisions_of(model))
    assert want and all(".layers.1." in f for f in want), want
    assert _float8_fqns(model) == want and fp8_layer_count(model) == len(want) == 7
    x = torch.randint(0, 1024, (2, 32))
    out = model(input_ids=x, labels=x)
    out.loss.backward()
    assert torch.isfinite(out.loss) and model.model.layers[1].mlp.up_proj.weight.grad is not None

    bf16 = prepare_for_trainer(_tiny_model(), fp8=False, report=False)
    assert fp8_layer_count(bf16) == 0 and not fp8_fqns(decisions_of(bf16)) and decisions_of(bf16)


@pytest.fixture
def fresh_accelerate_state():
    from accelerate.state import AcceleratorState, GradientState

    yield
    AcceleratorState._reset_state(True)  # the state is process-wide: leave none for other tests
    GradientState._reset_state()


def test_accelerate_ao_route_converts_fp8kits_decisions(fresh_accelerate_state):
    from accelerate import Accelerator
    from accelerate.utils.ao import find_first_last_linear_layers

    from fp8kit.config.options import decide_options
    from fp8kit.integrations.accelerate import ao_recipe_kwargs, fp8kit_module_filter
    from fp8kit.parallel.convert import fp8_fqns
    from fp8kit.selective.decide import decide
    from fp8kit.selective.sites import find_sites

    model = _tiny_model()
    config = FP8Config(recipe="rowwise", exclude=["layers.0.mlp"])
    want = fp8_fqns(decide(find_sites(model), decide_options(config, None)))
    first, last = find_first_last_linear_layers(model)
    handler = ao_recipe_kwargs(model, config)
    accelerator = Accelerator(mixed_precision="fp8", cpu=True, kwargs_handlers=[handler])
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3)
    model, optimizer = accelerator.prepare(model, optimizer)
    assert accelerator.fp8_enabled and str(accelerator.fp8_backend).endswith("AO")
    got = _float8_fqns(model)
    assert got == want and len(got) == 11, (sorted(got), sorted(want))  # 4 attention + 7 of layer 1
    assert first in got, "fp8kit's filter, not Accelerate's default (which skips the first linear)"
    x = torch.randint(0, 1024, (4, 33), generator=torch.Generator().manual_seed(0))
    losses = []
    for _ in range(4):
        with accelerator.autocast():
            loss = model(input_ids=x, labels=x).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.1, losses

    f = fp8kit_module_filter([])
    assert not f(nn.Linear(16, 16), "model.layers.0.mlp.up_proj")
    f = fp8kit_module_filter(decide(find_sites(_tiny_model()), decide_options(FP8Config(), None)))
    for name in ("model.layers.0.mlp.up_proj", "module.model.layers.0.mlp.up_proj",
                 "_orig_mod.model.layers.0.mlp.up_proj"):
        assert f(nn.Linear(256, 688), name), name
    assert not f(nn.Linear(256, 1024), "lm_head") and not f(nn.Embedding(4, 4), "model.embed_tokens")


def test_accelerate_route_refuses_fp8kit_only_recipes():
    from fp8kit.integrations.accelerate import ao_recipe_kwargs

    with pytest.raises(ConfigError, match="blockwise"):
        ao_recipe_kwargs(_tiny_model(), FP8Config(recipe="blockwise"))


def test_prepare_for_trainer_keeps_the_delayed_recipe_settings():
    """The Trainer route passes fp8.amax_history_len / amax_compute_algo / margin on to the delayed linears (they
    were silently replaced by the defaults before)."""
    from fp8kit.fp8.delayed import Float8DelayedLinear
    from fp8kit.integrations.transformers import prepare_for_trainer

    cfg = FP8Config(recipe="delayed", amax_history_len=3, amax_compute_algo="most_recent", margin=2)
    model = prepare_for_trainer(_tiny_model(), config=cfg, report=False)
    delayed = [m for m in model.modules() if isinstance(m, Float8DelayedLinear)]
    assert delayed, "no delayed linears"
    settings = {(m._state.config.amax_history_len, m._state.config.amax_compute_algo, m._state.config.margin)
                for m in delayed}
    assert settings == {(3, "most_recent", 2)}, settings

"""Fine-tune a causal LM with ``transformers.Trainer``, in FP8 through fp8kit (``--fp8``) or in BF16.

    python examples/hf_trainer.py --model tiny --max_steps 10 --output_dir /tmp/hf-fp8 --fp8   # CPU, < 2 min
    python examples/hf_trainer.py --model path/to/hf_model_dir --max_steps 200 --output_dir out --fp8

``--model`` is a local Hugging Face model directory (weights, config, tokenizer) or an fp8kit preset name
(random initialisation, a byte-level BPE trained on the data). The data: text files or globs, or .jsonl
files with a ``text`` field or a ``messages`` list (rendered with the tokenizer's chat template when it has
one), tokenized and packed into ``--seq_len`` windows (every token is a target: plain causal-LM packing;
for prompt masking use ``fp8kit train``). The two fp8kit lines are marked ``# fp8kit``.

Prints the FP8 layer count and the loss per step; writes ``OUTPUT_DIR/hf_trainer_result.json`` (losses,
tokens/s, median step time, peak memory, FP8 layers) and, unless ``--no_save``, the fine-tuned model
(``trainer.save_model``: plain transformers loads it).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import time
from pathlib import Path

import torch


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny", help="a local HF model directory, or an fp8kit preset (tiny, llama-125m, ...)")
    p.add_argument("--output_dir", required=True)
    p.add_argument("--max_steps", type=int, default=10)
    p.add_argument("--fp8", action="store_true", help="convert with fp8kit (FP8 linears, conversion report)")
    p.add_argument("--recipe", default="tensorwise", help="fp8kit FP8 recipe (tensorwise, rowwise, ...)")
    p.add_argument("--policy", default=None,
                   help="selective FP8: a policy JSON or builtin:NAME (FP8 only where it measured faster)")
    p.add_argument("--data", nargs="*", default=None,
                   help="text / .jsonl files or globs (default: the Python standard library's email package)")
    p.add_argument("--seq_len", type=int, default=64)
    p.add_argument("--batch_size", type=int, default=4, help="per-device train batch size (sequences)")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--num_layers", type=int, default=None, help="preset only: override the depth")
    p.add_argument("--vocab_size", type=int, default=1024, help="preset only: size of the BPE trained on the data")
    p.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16", help="parameter dtype (bf16 autocast either way)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--compile", action="store_true", help="TrainingArguments(torch_compile=True)")
    p.add_argument("--activation_checkpointing", action="store_true", help="recompute each block in backward")
    p.add_argument("--no_save", action="store_true", help="do not save the model at the end")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def read_texts(patterns: list[str] | None, tokenizer=None) -> list[str]:
    """Documents from text files and .jsonl (``text`` or chat ``messages``)."""
    if not patterns:
        import email

        patterns = [os.path.join(os.path.dirname(email.__file__), "*.py")]
    files = sorted({f for pat in patterns for f in (glob.glob(pat) or [pat])})
    missing = [f for f in files if not os.path.isfile(f)]
    if missing:
        raise SystemExit(f"error: --data: no such file: {', '.join(repr(f) for f in missing)}")
    texts = []
    for f in files:
        if f.endswith(".jsonl"):
            for n, line in enumerate(Path(f).read_text(encoding="utf-8").splitlines(), 1):
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError as e:
                    raise SystemExit(f"error: --data {f}:{n}: not a JSON object ({e.msg})") from None
                if not isinstance(rec, dict) or ("messages" not in rec and "text" not in rec):
                    raise SystemExit(f"error: --data {f}:{n}: expected an object with 'text' or 'messages'")
                if "messages" in rec and tokenizer is not None and getattr(tokenizer, "chat_template", None):
                    texts.append(tokenizer.apply_chat_template(rec["messages"], tokenize=False))
                elif "messages" in rec:
                    texts.append("\n".join(f"{m['role']}: {m['content']}" for m in rec["messages"]))
                else:
                    texts.append(rec["text"])
        else:
            texts.append(Path(f).read_text(encoding="utf-8", errors="replace"))
    if not texts:
        raise SystemExit(f"error: no data in {patterns}")
    return texts


def load_model_and_tokenizer(args):
    """(model, tokenizer): a local HF directory, or an fp8kit preset with a BPE trained on the data."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    if os.path.isdir(args.model):
        tok = AutoTokenizer.from_pretrained(args.model, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype, local_files_only=True,
                                                     use_safetensors=True)
        return model, tok, read_texts(args.data, tok)
    from fp8kit.data.tokenizer import EOS_TOKEN, train_bpe
    from fp8kit.models.presets import PRESETS

    if args.model not in PRESETS:
        raise SystemExit(f"error: --model {args.model!r} is neither a directory nor a preset ({', '.join(PRESETS)})")
    texts = read_texts(args.data)
    tok = PreTrainedTokenizerFast(tokenizer_object=train_bpe(texts, args.vocab_size), eos_token=EOS_TOKEN)
    kwargs = dict(PRESETS[args.model])
    model_type = kwargs.pop("model_type")
    if args.num_layers:
        kwargs["num_hidden_layers"] = args.num_layers
    cfg = AutoConfig.for_model(model_type, **kwargs, vocab_size=args.vocab_size,
                               eos_token_id=tok.eos_token_id, bos_token_id=None, pad_token_id=None)
    torch.manual_seed(args.seed)
    return AutoModelForCausalLM.from_config(cfg, dtype=dtype), tok, texts


class PackedWindows(torch.utils.data.Dataset):
    """Documents tokenized, joined with EOS, cut into ``seq_len`` windows (labels = inputs; the model shifts)."""

    def __init__(self, texts: list[str], tokenizer, seq_len: int):
        ids: list[int] = []
        eos = tokenizer.eos_token_id
        for enc in tokenizer(texts, add_special_tokens=False)["input_ids"]:
            ids.extend(enc + ([eos] if eos is not None else []))
        n = len(ids) // seq_len
        if n == 0:
            raise SystemExit(f"error: the data has {len(ids)} tokens, fewer than one window of {seq_len}")
        self.windows = torch.tensor(ids[: n * seq_len], dtype=torch.long).view(n, seq_len)

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.windows[i], "labels": self.windows[i]}


def main(argv=None) -> dict:
    args = parse_args(argv)
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from fp8kit.integrations.transformers import (  # fp8kit
        FP8ReportCallback,
        fp8_layer_count,
        prepare_for_trainer,
    )

    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    model, tok, texts = load_model_and_tokenizer(args)
    model.to(device)
    data = PackedWindows(texts, tok, args.seq_len)
    callbacks = []
    if args.fp8:
        from fp8kit.config import FP8Config, SelectiveConfig

        selective = SelectiveConfig(selective_fp8=True, fp8_dynamic_policy_path=args.policy) if args.policy else None
        model = prepare_for_trainer(model, config=FP8Config(recipe=args.recipe), selective=selective,  # fp8kit
                                    num_tokens=args.batch_size * args.seq_len)
        callbacks.append(FP8ReportCallback(model))
    linears = sum(isinstance(m, torch.nn.Linear) for m in model.modules())
    fp8_layers = fp8_layer_count(model)
    what = "fp8kit; the report's sites above also count the embedding" if args.fp8 else "bf16 baseline"
    print(f"FP8 layers: {fp8_layers} of {linears} linear layers ({what})", flush=True)

    class StepTimer(TrainerCallback):
        """Wall time of each optimizer step (CUDA synchronised), for tokens/s."""

        def __init__(self):
            self.times: list[float] = []
            self._t0 = 0.0

        def on_step_begin(self, args_, state, control, **kw):
            if device == "cuda":
                torch.cuda.synchronize()
            self._t0 = time.perf_counter()

        def on_step_end(self, args_, state, control, **kw):
            if device == "cuda":
                torch.cuda.synchronize()
            self.times.append(time.perf_counter() - self._t0)

    timer = StepTimer()
    targs = TrainingArguments(
        output_dir=args.output_dir, max_steps=args.max_steps, per_device_train_batch_size=args.batch_size,
        learning_rate=args.lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        logging_steps=1, save_strategy="no", report_to="none", bf16=True, use_cpu=device == "cpu",
        dataloader_num_workers=0, seed=args.seed, disable_tqdm=True, torch_compile=args.compile,
        **({"activation_checkpointing": True} if args.activation_checkpointing else {}),
    )
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    trainer = Trainer(model=model, args=targs, train_dataset=data, callbacks=[*callbacks, timer])
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    for i, loss in enumerate(losses, 1):
        print(f"step {i:>4} loss {loss:.4f}")
    steady = timer.times[min(3, len(timer.times) - 1):] or timer.times  # without the first (warm-up) steps
    step_s = statistics.median(steady)
    result = {
        "model": args.model, "fp8": args.fp8, "recipe": args.recipe if args.fp8 else None, "policy": args.policy,
        "device": device,
        "fp8_layers": fp8_layers, "linear_layers": linears, "losses": losses,
        "step_ms_median": step_s * 1e3, "tokens_per_s": args.batch_size * args.seq_len / step_s,
        "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None,
        "steps": len(timer.times), "seq_len": args.seq_len, "batch_size": args.batch_size,
    }
    Path(args.output_dir).mkdir(parents=True, exist_ok=True)
    (Path(args.output_dir) / "hf_trainer_result.json").write_text(json.dumps(result, indent=1) + "\n")
    if not args.no_save:
        trainer.save_model(args.output_dir)
        tok.save_pretrained(args.output_dir)
    print(f"tokens/s {result['tokens_per_s']:.0f}, median step {result['step_ms_median']:.1f} ms; "
          f"results in {args.output_dir}/hf_trainer_result.json")
    return result


if __name__ == "__main__":
    from fp8kit.base.errors import Fp8kitError

    try:
        main()
    except Fp8kitError as e:  # bad input (a recipe name, a policy file, ...): one line, as fp8kit's CLI prints it
        raise SystemExit(f"error: {e}") from None

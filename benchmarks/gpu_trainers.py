"""GPU proof: TRL's SFTTrainer and transformers' Trainer train on packprep shards through a varlen
attention path, in bf16, with the packed loss equal to the one-by-one loss.

For each trainer, following its README recipe exactly (layout ``trl`` for TRL, ``packprep`` +
``collate_packed`` for the Trainer):

1. ``check_pipeline(trainer, data=...)``: one packed row through the trainer's own path;
2. exactness: ``--check-batches`` batches that the trainer builds itself (``get_train_dataloader``
   + ``_prepare_inputs``), their summed loss from the trainer's own ``compute_loss`` vs the same
   sequences run one by one (max logit difference, relative summed-loss difference);
3. speed: ``trainer.train()`` for ``--steps`` optimizer steps; tokens/s counted from the batches
   its collator built (the first step, which includes warm-up, is left out of the rate).

    python benchmarks/gpu_trainers.py CONVERSATIONS... --tokenizer TOK [--max-len 4096] [--steps 30]
    python benchmarks/gpu_trainers.py examples/chats.jsonl --tokenizer examples/tokenizer --tiny   # CPU check

The model is a random-weight Llama in bf16 (``--model-shape 1b``: Llama-3.2-1B; ``--tiny``: hidden 64,
2 layers, fp32 on CPU). Attention: ``packprep.training.register_varlen_attention()`` (torch's varlen_attn)
when it is available, else ``flash_attention_2`` if installed, else SDPA (transformers' packed path).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import torch  # noqa: E402
import transformers  # noqa: E402

import packprep  # noqa: E402
from packprep.convert import export  # noqa: E402
from packprep.training import PackedDataset, check_pipeline, collate_packed, register_varlen_attention  # noqa: E402
from packprep.training.isolation import locate_sequences  # noqa: E402

SHAPES = {  # random-weight Llama shapes
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8, rope_theta=500000.0, tie_word_embeddings=True),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=4, initializer_range=0.5),
}


def attention() -> str:
    name = register_varlen_attention()
    if name:
        return name
    try:
        import flash_attn  # noqa: F401

        return "flash_attention_2"
    except ImportError:
        return "sdpa"


def make_model(tokenizer, shape: str, attn: str, dtype, device):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=len(tokenizer), max_position_embeddings=131072,
                                      pad_token_id=tokenizer.pad_token_id, **SHAPES[shape])
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn, dtype=dtype)
    return model.to(device)


class CountingCollator:
    """Wraps the trainer's collator: counts the tokens of every batch it builds, with a timestamp."""

    def __init__(self, collate):
        self.collate, self.log = collate, []

    def __call__(self, rows):
        batch = self.collate(rows)
        self.log.append((time.perf_counter(), int(batch["input_ids"].numel())))
        return batch


def exactness(trainer, folder, batches: int) -> dict:
    """Summed loss of the trainer's own batches via its compute_loss vs the sequences one by one."""
    model, dataset = trainer.model, PackedDataset(folder)
    model.eval()
    loader = iter(trainer.get_train_dataloader())
    packed_sum = alone_sum = 0.0
    worst = 0.0
    sequences = 0
    with torch.no_grad():
        for _ in range(batches):
            inputs = trainer._prepare_inputs(next(loader))
            ids, labels = inputs["input_ids"][0], inputs["labels"][0]
            packed_sum += float(trainer.compute_loss(model, dict(inputs), num_items_in_batch=1))
            logits = model(**inputs).logits[0].float()
            for a, n in locate_sequences(dataset, ids.cpu().numpy()):
                one = model(input_ids=ids[a : a + n][None], use_cache=False).logits[0].float()
                worst = max(worst, float((logits[a : a + n] - one).abs().max()))
                alone_sum += float(torch.nn.functional.cross_entropy(one[:-1], labels[a + 1 : a + n],
                                                                     ignore_index=-100, reduction="sum"))
                sequences += 1
    model.train()
    return {"batches": batches, "sequences": sequences, "loss_packed_sum": packed_sum, "loss_alone_sum": alone_sum,
            "relative_diff": abs(packed_sum - alone_sum) / abs(alone_sum), "max_logit_diff": worst}


def speed(trainer) -> dict:
    trainer.data_collator = counter = CountingCollator(trainer.data_collator)
    start = time.perf_counter()
    trainer.train()
    if trainer.args.use_cpu is False and torch.cuda.is_available():
        torch.cuda.synchronize()
    total = time.perf_counter() - start
    log = counter.log
    steady = sum(n for _, n in log[1:]) / max(1e-9, (time.perf_counter() - log[1][0])) if len(log) > 2 else None
    return {"steps": trainer.state.global_step, "seconds": round(total, 2), "tokens": sum(n for _, n in log),
            "tokens_per_s": round(sum(n for _, n in log) / total, 1),
            "tokens_per_s_after_first_step": round(steady, 1) if steady else None,
            "final_loss": trainer.state.log_history[-1].get("train_loss")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("inputs", nargs="+", help="conversation files, as for packprep pack")
    parser.add_argument("--tokenizer", required=True)
    parser.add_argument("--max-len", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rows-per-step", type=int, default=1, help="per_device_train_batch_size (packed rows)")
    parser.add_argument("--check-batches", type=int, default=4)
    parser.add_argument("--model-shape", default="1b", choices=sorted(SHAPES))
    parser.add_argument("--tiny", action="store_true", help="CPU dry run: tiny fp32 model, 2 steps, max-len 256")
    parser.add_argument("--trainers", default="trl,hf")
    parser.add_argument("--work", default=None, help="folder for the packed shards [default: a temporary one]")
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args()
    if args.tiny:
        args.model_shape, args.steps, args.max_len = "tiny", 2, min(args.max_len, 256)
        args.check_batches = min(args.check_batches, 2)
    cuda = torch.cuda.is_available() and not args.tiny
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    attn = attention() if cuda else "sdpa"
    tokenizer = transformers.AutoTokenizer.from_pretrained(args.tokenizer)
    work = args.work or tempfile.mkdtemp(prefix="gpu_trainers-")
    folders = {"packprep": os.path.join(work, "packed"), "trl": os.path.join(work, "packed-trl")}
    if not os.path.exists(folders["packprep"]):
        packprep.pack(args.inputs, folders["packprep"], args.tokenizer, max_len=args.max_len)
    if not os.path.exists(folders["trl"]):
        export(folders["packprep"], "trl", folders["trl"])
    common = dict(per_device_train_batch_size=args.rows_per_step, max_steps=args.steps, learning_rate=1e-5,
                  logging_steps=max(1, args.steps // 5), report_to=[], save_strategy="no", use_cpu=not cuda,
                  dataloader_num_workers=0, seed=0)  # collate in this process: CountingCollator sees every batch
    results = {"device": torch.cuda.get_device_name() if cuda else "cpu", "dtype": str(dtype), "attention": attn,
               "model_shape": args.model_shape, "max_len": args.max_len, "torch": torch.__version__,
               "transformers": transformers.__version__}
    import datasets

    for name in args.trainers.split(","):
        model = make_model(tokenizer, args.model_shape, attn, dtype, device)
        if name == "trl":
            import trl

            folder = folders["trl"]
            config = trl.SFTConfig(output_dir=os.path.join(work, "out-trl"), padding_free=True, max_length=None,
                                   dataset_kwargs={"skip_prepare_dataset": True}, **common)
            trainer = trl.SFTTrainer(model=model, args=config, processing_class=tokenizer,
                                     train_dataset=datasets.load_dataset(folder, split="train"))
            results["trl_version"] = trl.__version__
        else:
            folder = folders["packprep"]
            trainer = transformers.Trainer(
                model=model, args=transformers.TrainingArguments(output_dir=os.path.join(work, "out-hf"), **common),
                train_dataset=datasets.load_dataset(folder, split="train"), data_collator=collate_packed)
        guard = check_pipeline(trainer, data=folder)
        result = {"check_pipeline": guard, "exactness": exactness(trainer, folder, args.check_batches),
                  "speed": speed(trainer)}
        results[name] = result
        ex = result["exactness"]
        print(f"{name}: packed loss {ex['loss_packed_sum']:.4f} vs one-by-one {ex['loss_alone_sum']:.4f} "
              f"(relative diff {ex['relative_diff']:.2e}, max logit diff {ex['max_logit_diff']:.3g}, "
              f"{ex['sequences']} sequences); {result['speed']['tokens_per_s']:,.0f} tokens/s "
              f"({result['speed']['tokens_per_s_after_first_step'] or 0:,.0f} after the first step) over "
              f"{result['speed']['steps']} steps, attention {attn}, {dtype}", flush=True)
        del trainer, model
        if cuda:
            torch.cuda.empty_cache()
    print(json.dumps(results, indent=2, default=str))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(results, handle, indent=2, default=str)


if __name__ == "__main__":
    main()

"""lm-evaluation-harness against pdserve, as its users run it, beside lm-eval's own `hf` model on the same
weights: the default model (as a Hugging Face folder, float32), offline tasks written here.

    bash bench/clients_env.sh                  # once: .venv-clients with lm-eval[api], torch, transformers
    .venv-clients/bin/python bench/bench_lm_eval.py [--json OUT]
    .venv/bin/python bench/bench_lm_eval.py --smoke [--json OUT]

Tasks (local JSONL, written into a temporary folder):
- `pdserve_mc`: 24 multiple-choice questions, scored by loglikelihood (lm-eval sends each context and
  choice as token ids with echo, logprobs 1, max_tokens 1, and sums the prompt logprobs of the choice);
- `pdserve_gen`: 12 short questions answered by generate_until ("\\n", 16 tokens, greedy).

Servers (pdserve.testing.launch, loopback): a prefill-server and a decode-server (disaggregated), and a
decode-server with `--prefill local` (colocated). Models: `local-completions` on each (tokenized
requests, the model's own tokenizer, batches of 4 prompts a call), `local-chat-completions` on the
disaggregated one for the generation task, `hf` in this process. Printed: each run's accuracy and exact
match, and against `hf`: the largest loglikelihood difference, the is_greedy disagreements, the
generated answers that differ. --smoke: writes the tasks and checks them (their YAML and JSONL read back;
with lm-eval installed, its task manager finds them); no servers, no evaluation.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import tempfile
from pathlib import Path

from pdserve.bench.common import report

MC = [  # question, choices, index of the answer
    ("What is the capital of France?", ["Paris", "London", "Berlin", "Madrid"], 0),
    ("What is the capital of Japan?", ["Beijing", "Seoul", "Tokyo", "Bangkok"], 2),
    ("What is the capital of Italy?", ["Rome", "Athens", "Vienna", "Lisbon"], 0),
    ("How many legs does a spider have?", ["Six", "Eight", "Ten", "Four"], 1),
    ("How many days are in a week?", ["Five", "Six", "Seven", "Eight"], 2),
    ("What colour is the sky on a clear day?", ["Green", "Red", "Blue", "Black"], 2),
    ("Which planet is closest to the Sun?", ["Venus", "Mercury", "Earth", "Mars"], 1),
    ("What do bees make?", ["Milk", "Silk", "Honey", "Wool"], 2),
    ("What is frozen water called?", ["Steam", "Ice", "Sand", "Glass"], 1),
    ("Which animal is known as the king of the jungle?", ["Lion", "Mouse", "Cow", "Sheep"], 0),
    ("What is 2 + 2?", ["3", "4", "5", "22"], 1),
    ("What is 10 - 3?", ["7", "6", "13", "30"], 0),
    ("Which gas do plants take in from the air?", ["Oxygen", "Helium", "Carbon dioxide", "Neon"], 2),
    ("What is the largest ocean on Earth?", ["Atlantic", "Indian", "Arctic", "Pacific"], 3),
    (
        "Who wrote Romeo and Juliet?",
        ["Charles Dickens", "William Shakespeare", "Jane Austen", "Mark Twain"],
        1,
    ),
    ("At what temperature does water boil, in Celsius?", ["50 degrees", "100 degrees", "0 degrees", "7"], 1),
    ("Which language is spoken in Brazil?", ["Spanish", "French", "Portuguese", "German"], 2),
    ("How many continents are there?", ["Five", "Six", "Seven", "Nine"], 2),
    ("What is the opposite of hot?", ["Warm", "Cold", "Big", "Fast"], 1),
    ("Which shape has three sides?", ["Square", "Circle", "Triangle", "Hexagon"], 2),
    ("What do cows drink?", ["Water", "Milk", "Juice", "Oil"], 0),
    ("Which month comes after January?", ["March", "February", "December", "June"], 1),
    ("What is the chemical symbol for gold?", ["Ag", "Au", "Gd", "Go"], 1),
    ("Which organ pumps blood through the body?", ["Liver", "Lung", "Heart", "Brain"], 2),
]
GEN = [  # question, answer
    ("What is the capital of France?", "Paris"),
    ("What is the capital of Germany?", "Berlin"),
    ("What is 3 + 4?", "7"),
    ("What colour is grass?", "Green"),
    ("How many hours are in a day?", "24"),
    ("What is the largest planet in our solar system?", "Jupiter"),
    ("What is the opposite of up?", "Down"),
    ("What animal says moo?", "Cow"),
    ("What is the first letter of the alphabet?", "A"),
    ("What is 5 times 2?", "10"),
    ("Which season comes after winter?", "Spring"),
    ("What is the capital of Spain?", "Madrid"),
]


def write_tasks(folder: Path) -> None:
    with (folder / "mc.jsonl").open("w") as f:
        for question, choices, answer in MC:
            doc = {"question": question, "choices": [" " + c for c in choices], "answer": answer}
            f.write(json.dumps(doc) + "\n")
    with (folder / "gen.jsonl").open("w") as f:
        for question, answer in GEN:
            f.write(json.dumps({"question": question, "answer": answer}) + "\n")
    common = 'dataset_path: json\ntest_split: test\ndoc_to_text: "Question: {{question}}\\nAnswer:"\n'
    (folder / "pdserve_mc.yaml").write_text(
        "task: pdserve_mc\n" + common + f"dataset_kwargs:\n  data_files:\n    test: {folder / 'mc.jsonl'}\n"
        'output_type: multiple_choice\ndoc_to_choice: "{{choices}}"\ndoc_to_target: answer\n'
        "metric_list:\n  - metric: acc\n"
    )
    (folder / "pdserve_gen.yaml").write_text(
        "task: pdserve_gen\n" + common + f"dataset_kwargs:\n  data_files:\n    test: {folder / 'gen.jsonl'}\n"
        'output_type: generate_until\ndoc_to_target: " {{answer}}"\n'
        'generation_kwargs:\n  until: ["\\n"]\n  max_gen_toks: 16\n  do_sample: false\n  temperature: 0\n'
        "filter_list:\n  - name: strip\n    filter:\n"
        "      - function: remove_whitespace\n      - function: take_first\n"
        "metric_list:\n  - metric: exact_match\n    ignore_case: true\n    ignore_punctuation: true\n"
    )


def evaluate(model: str, model_args: dict, tasks: list[str], folder: Path, chat: bool = False) -> dict:
    import lm_eval
    from lm_eval.tasks import TaskManager

    out = lm_eval.simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=tasks,
        task_manager=TaskManager(include_path=str(folder)),
        log_samples=True,
        apply_chat_template=chat,
        batch_size=4 if model != "local-chat-completions" else 1,
    )
    return {task: (out["results"][task], out["samples"][task]) for task in tasks}


def by_doc(samples: list[dict]) -> dict:
    return {s["doc_id"]: s for s in samples}


def compare(reference: dict, run: dict) -> dict:
    """Against `hf`'s: loglikelihoods (largest difference, is_greedy disagreements), generated answers."""
    out = {}
    if "pdserve_mc" in run:
        ref, got = by_doc(reference["pdserve_mc"][1]), by_doc(run["pdserve_mc"][1])
        diffs, greedy = [], 0
        for doc, sample in got.items():
            for (ll, is_greedy), (ll_ref, is_greedy_ref) in zip(
                sample["filtered_resps"], ref[doc]["filtered_resps"], strict=True
            ):
                diffs.append(abs(float(ll) - float(ll_ref)))
                greedy += bool(is_greedy) != bool(is_greedy_ref)
        out["mc_acc"] = run["pdserve_mc"][0]["acc,none"]
        out["mc_max_loglikelihood_diff"] = max(diffs)
        out["mc_is_greedy_disagreements"] = greedy
    if "pdserve_gen" in run:
        ref, got = by_doc(reference["pdserve_gen"][1]), by_doc(run["pdserve_gen"][1])
        out["gen_exact_match"] = run["pdserve_gen"][0]["exact_match,strip"]
        out["gen_answers_differing"] = [
            (ref[d]["resps"][0][0], s["resps"][0][0]) for d, s in got.items() if s["resps"] != ref[d]["resps"]
        ]
    return out


def smoke() -> dict:
    """The tasks written and read back: documents per task (each task's YAML names its JSONL file), and
    whether lm-eval's task manager (when installed) finds them."""
    folder = Path(tempfile.mkdtemp(prefix="bench-lm-eval-smoke-"))
    write_tasks(folder)
    out = {}
    for task, data in (("pdserve_mc", folder / "mc.jsonl"), ("pdserve_gen", folder / "gen.jsonl")):
        assert f"test: {data}" in (folder / f"{task}.yaml").read_text(), task
        out[task] = {"documents": len([json.loads(line) for line in data.read_text().splitlines()])}
    if importlib.util.find_spec("lm_eval") is not None:
        from lm_eval.tasks import TaskManager

        found = TaskManager(include_path=str(folder)).all_tasks
        out["lm_eval_finds_tasks"] = all(task in found for task in ("pdserve_mc", "pdserve_gen"))
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path)
    parser.add_argument("--smoke", action="store_true", help="write and check the tasks; no servers")
    args = parser.parse_args(argv)
    if args.smoke:
        report(smoke(), args.json)
        return

    from pdserve.engine.loading.sources import DEFAULT_MODEL, cache_dir, fetch
    from pdserve.testing.launch import ENGINE_ARGS, decode_server, prefill_server
    from pdserve.testing.models import hf_folder

    gguf = fetch(DEFAULT_MODEL, progress=False)
    folder = hf_folder(gguf, cache_dir() / "bench-hf" / "SmolLM2-135M-Instruct")
    tasks_dir = Path(tempfile.mkdtemp(prefix="bench-lm-eval-"))
    write_tasks(tasks_dir)
    logs = tasks_dir / "logs"
    logs.mkdir()
    name = ["--served-model-name", "smollm2"]
    prefill = prefill_server(folder, logs, engine_args=ENGINE_ARGS)
    servers = {
        "disaggregated": decode_server(folder, prefill.address, logs, name="decode", extra=name),
        "colocated": decode_server(folder, "local", logs, name="colocated", extra=name),
    }
    both = ["pdserve_mc", "pdserve_gen"]
    try:
        local = {"pretrained": str(folder), "dtype": "float32", "device": "cpu"}
        hf = evaluate("hf", local, both, tasks_dir)
        hf_chat = evaluate("hf", local, ["pdserve_gen"], tasks_dir, chat=True)
        scores = {
            "mc_acc": hf["pdserve_mc"][0]["acc,none"],
            "gen_exact_match": hf["pdserve_gen"][0]["exact_match,strip"],
        }
        result = {"hf": scores}
        for role, server in servers.items():
            completions = {
                "model": "smollm2",
                "base_url": f"http://{server.addresses['http']}/v1/completions",
                "tokenizer_backend": "huggingface",
                "tokenizer": str(folder),
                "tokenized_requests": True,
                "max_retries": 1,
            }
            run = evaluate("local-completions", completions, both, tasks_dir)
            result[f"local-completions {role}"] = compare(hf, run)
        chat_args = {
            "model": "smollm2",
            "base_url": f"http://{servers['disaggregated'].addresses['http']}/v1/chat/completions",
            "max_retries": 1,
        }
        chat = evaluate("local-chat-completions", chat_args, ["pdserve_gen"], tasks_dir, chat=True)
        result["local-chat-completions disaggregated"] = compare(hf_chat, chat)
    finally:
        for server in servers.values():
            server.terminate()
        prefill.terminate()
    report(result, args.json)


if __name__ == "__main__":
    main()

"""`attnlab generate`: text from a task=lm run, decoded as an RNN, reproducible by seed; one-line errors."""

from __future__ import annotations

import shutil
from functools import partial
from types import SimpleNamespace

import pytest
import torch

from attnlab.attention import build_attention
from attnlab.cli.main import main
from attnlab.errors import UserError
from attnlab.models.causal_lm import CausalLM, causal_backends
from attnlab.pipeline import train
from attnlab.tasks.lm_runs import encode_prompt
from attnlab.tasks.sampling import generate, next_token
from conftest import compose_train_config

TINY = [
    "task=lm", "task.data.source.tokenizer.vocab_size=384", "task.data.seq_len=24", "task.data.batch_size=8",
    "task.model.dim=16", "task.model.depth=1", "task.model.num_heads=2", "task.max_steps=3",
    "task.val_check_interval=3", "trainer.enable_progress_bar=false", "trainer.num_sanity_val_steps=0",
    "logger=csv", "test=false",
]  # fmt: skip

# on one worker under `make test`: the module's two runs (`runs`) are trained once, not per worker
pytestmark = pytest.mark.xdist_group("generate_runs")


@pytest.fixture(scope="module")
def runs(tmp_path_factory, corpus_data_dir):
    """Two tiny task=lm runs sharing their data: linear with RoPE, softmax with learned positions."""
    data = corpus_data_dir
    out = {}
    for name, extra in (("linear", []), ("softmax", ["task.model.positions=learned"])):
        tmp = tmp_path_factory.mktemp(name)
        train(compose_train_config([*TINY, f"attn={name}", f"paths.data_dir={data}", *extra], tmp))
        out[name] = tmp / "run"
    return out


def generate_cli(capsys, *args):
    code = main(["generate", *map(str, args), "--quiet"])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_generates_text_reproducibly_from_a_run_dir_or_a_checkpoint(runs, capsys):
    run = runs["linear"]
    code, text, err = generate_cli(capsys, run, "--prompt", "The value", "--max-new-tokens", 12, "--seed", 3)
    assert code == 0 and text.startswith("The value") and len(text.strip()) > len("The value")
    assert "linear: 12 tokens in" in err and "tokens/s" in err and "prompt of" in err
    again = generate_cli(capsys, run, "--prompt", "The value", "--max-new-tokens", 12, "--seed", 3)[1]
    assert again == text  # the seed decides the sample
    checkpoint = next((run / "checkpoints").glob("*.ckpt"))
    greedy = [
        generate_cli(capsys, p, "--max-new-tokens", 8, "--temperature", 0, "--seed", s)[1]
        for p, s in ((run, 0), (checkpoint, 1))
    ]
    assert greedy[0] == greedy[1]  # greedy ignores the seed; a checkpoint finds its run's config
    # RoPE: a model without a position table decodes past its training length
    code, text, _ = generate_cli(capsys, run, "--max-new-tokens", 40, "--top-k", 5)
    assert code == 0 and text


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("missing", "no such run dir or checkpoint"),
        ("no_config", "is not a run dir: it has no config.yaml"),
        (
            "other_task",
            "is a task=mlm run (model attnlab.models.mlm.MaskedLanguageModel); generate needs a causal",
        ),
        ("no_checkpoint", "no checkpoint in"),
        ("no_tokenizer", "has no tokenizer ('attnlab_lm'): a task=mqar checkpoint"),
        ("too_long", "exceed the model's 24 positions (learned positions); ask for at most"),
        ("temperature", "--temperature -1.0: expected a number >= 0"),
        ("device", "--device cuda: CUDA is not available here"),
    ],
)
def test_errors_are_one_line(runs, tmp_path, capsys, case, message):
    run, args = runs["softmax"], []
    if case == "missing":
        run = tmp_path / "nowhere"
    elif case == "no_config":
        run = tmp_path
    elif case in ("other_task", "no_checkpoint"):
        copy = tmp_path / "run"
        shutil.copytree(
            run, copy, ignore=shutil.ignore_patterns("*.ckpt") if case == "no_checkpoint" else None
        )
        if case == "other_task":
            config = (copy / "config.yaml").read_text()
            config = config.replace("name: lm", "name: mlm").replace(
                "attnlab.models.causal_lm.CausalLM", "attnlab.models.mlm.MaskedLanguageModel"
            )
            (copy / "config.yaml").write_text(config)
        run = copy
    elif case == "no_tokenizer":  # a causal LM without text: an MQAR run's checkpoint
        copy = tmp_path / "run"
        shutil.copytree(run, copy)
        (copy / "config.yaml").write_text(
            (copy / "config.yaml").read_text().replace("name: lm", "name: mqar")
        )
        for path in (copy / "checkpoints").glob("*.ckpt"):
            checkpoint = torch.load(path, weights_only=True)
            checkpoint.pop("attnlab_lm")
            torch.save(checkpoint, path)
        run = copy
    elif case == "too_long":
        args = ["--prompt", "a b c", "--max-new-tokens", "30"]
    elif case == "device":
        if torch.cuda.is_available():
            pytest.skip("CUDA is available here")
        args = ["--device", "cuda"]
    else:
        args = ["--temperature", "-1"]
    code, out, err = generate_cli(capsys, run, *args)
    assert code == 2 and not out
    assert err.startswith("attnlab generate: error: ") and message in err and err.count("\n") == 1


def test_a_prompt_the_tokenizer_cannot_encode_is_refused():
    """A byte-level BPE encodes any text; a tokenizer with an <unk> fallback could not."""
    vocab = {"a": 5, "b": 6}
    tokenizer = SimpleNamespace(unk_id=3, bos_id=1, encode=lambda text: [vocab.get(ch, 3) for ch in text])
    assert encode_prompt(tokenizer, "ab") == [1, 5, 6]
    with pytest.raises(UserError, match=r"characters the tokenizer does not know: 'xé'"):
        encode_prompt(tokenizer, "axbé")


@pytest.mark.parametrize("attn", causal_backends())
def test_greedy_decoding_equals_the_parallel_models_argmax(attn):
    """Prefill + steps pick the tokens that re-running the whole sequence through `forward` picks."""
    torch.manual_seed(0)
    options = {"redraw_interval": None} if attn == "performer" else {}
    model = CausalLM(33, partial(build_attention, attn, **options), dim=16, depth=2, num_heads=2, max_len=40)
    model = model.double().eval()
    prompt = [1, 7, 9, 4]
    out = generate(model, prompt, 12, temperature=0)
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(12):
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    assert out.tokens == ids[len(prompt) :]


def test_top_k_and_temperature():
    logits = torch.tensor([[0.0, 3.0, 2.0, -1.0]])
    draws = {int(next_token(logits, 1.0, 2, torch.Generator().manual_seed(s))) for s in range(200)}
    assert draws == {1, 2}  # only the two likeliest
    assert int(next_token(logits, 0.0, None, torch.Generator())) == 1


def test_a_position_table_allows_exactly_the_tokens_it_has_positions_for(runs, capsys):
    """Learned positions (max_len 24): the last new token is never fed back, so prompt + new - 1
    positions are read; the error's "at most" is the exact limit."""
    run = runs["softmax"]
    code, _, err = generate_cli(capsys, run, "--prompt", "a b c", "--max-new-tokens", 30)
    limit = int(err.rsplit("ask for at most", 1)[1])
    code, text, err = generate_cli(capsys, run, "--prompt", "a b c", "--max-new-tokens", limit)
    assert code == 0 and f"{limit} tokens in" in err
    prompt = int(err.split("prompt of ")[1].split()[0])
    assert limit == 24 - prompt + 1  # positions 0 .. 23 read, the last new token never fed back
    code, _, err = generate_cli(capsys, run, "--prompt", "a b c", "--max-new-tokens", limit + 1)
    assert code == 2 and f"ask for at most {limit}" in err


def test_a_rope_model_is_bounded_unless_asked_for_more(runs, capsys, monkeypatch):
    """A billion new tokens from a RoPE model used to start, with no bound and no estimate."""
    code, out, err = generate_cli(capsys, runs["linear"], "--max-new-tokens", 1_000_000_000)
    assert code == 2 and not out
    assert err.startswith(
        "attnlab generate: error: --max-new-tokens 1000000000: more than 100,000 new tokens"
    )
    assert "--allow-long" in err and err.count("\n") == 1
    from omegaconf import OmegaConf

    from attnlab.tasks import lm_runs

    # the limit, and the flag that lifts it, at a small scale: past the model's own max_len
    beyond = OmegaConf.load(runs["linear"] / "config.yaml").task.model.max_len + 2
    monkeypatch.setattr(lm_runs, "LONG_GENERATION", beyond - 1)
    assert generate_cli(capsys, runs["linear"], "--max-new-tokens", beyond)[0] == 2
    code, text, _ = generate_cli(capsys, runs["linear"], "--max-new-tokens", beyond, "--allow-long")
    assert code == 0 and text


def test_the_progress_bar_shows_the_time_left(runs, capsys):
    code = main(["generate", str(runs["linear"]), "--max-new-tokens", "5"])
    err = capsys.readouterr().err
    assert code == 0 and "ETA " in err and "tokens [" in err


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        ("config", "config.yaml: not a readable run config"),
        ("state_dict", "holds no state_dict"),
    ],
)
def test_a_damaged_run_is_one_line(runs, tmp_path, capsys, damage, message):
    copy = tmp_path / "run"
    shutil.copytree(runs["linear"], copy)
    if damage == "config":
        (copy / "config.yaml").write_text("task: [unclosed\n")
    else:
        for path in (copy / "checkpoints").glob("*.ckpt"):
            checkpoint = torch.load(path, weights_only=True)
            checkpoint.pop("state_dict")
            torch.save(checkpoint, path)
    code, out, err = generate_cli(capsys, copy)
    assert code == 2 and not out
    assert err.startswith("attnlab generate: error: ") and message in err and err.count("\n") == 1

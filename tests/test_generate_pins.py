"""`generate` options pinned to HF transformers 5.23's measured behaviour, without torch.

tests/fixtures/generate/tiny_options.json (written by tools/make_reference.py) holds HF's `generate`
on the committed "tiny" checkpoint for each case below: the prompt, the keywords, the sequences (greedy
cases), each step's count of finite processed scores per row, and case extras; and the
generation_config.json HF saves for that checkpoint when its config.json carries a few edits.
"""

import json
import shutil

import numpy as np
import paddle
import pytest

from paddleformers_glm.modeling import GlmMoeDsaForCausalLM

from .conftest import FIXTURES

CKPT = FIXTURES / "tiny" / "checkpoint"
HF = json.loads((FIXTURES / "generate" / "tiny_options.json").read_text())


@pytest.fixture(scope="module")
def model():
    paddle.set_device("cpu")
    return GlmMoeDsaForCausalLM.from_pretrained(CKPT, dtype="float32")


def _run(model, case: str):
    """This package's generate on the case's prompt and keywords, with HF's record of the case."""
    hf = HF["cases"][case]
    mask = hf["attention_mask"]
    out = model.generate(
        paddle.to_tensor(hf["input_ids"]),
        None if mask is None else paddle.to_tensor(mask),
        **hf["kwargs"],
        seed=0,
        return_dict_in_generate=True,
        output_scores=True,
        output_logits=True,
    )
    finite = [np.isfinite(s.numpy()).sum(-1).tolist() for s in out.scores]
    return out, finite, hf


def _assert_greedy_case(model, case: str):
    out, finite, hf = _run(model, case)
    np.testing.assert_array_equal(out.sequences.numpy(), hf["sequences"])
    assert finite == hf["finite_per_step"]
    return out, hf


def test_sampling_without_top_k_keeps_hfs_default_50_tokens(model):
    """HF's generate with do_sample=True and no top_k (nor a generation_config.json) applies its
    default top_k 50: measured, the step-0 processed scores of both rows have exactly 50 finite
    entries, the 50 largest logits (their ids in the fixture). Sampling from all 256 tokens would
    change every default sampled generation. The scores do not depend on the seed."""
    out, finite, hf = _run(model, "sample_default_top_k")
    assert finite == hf["finite_per_step"] == [[50, 50]]
    scores, logits = out.scores[0].numpy(), out.logits[0].numpy()
    for b in range(scores.shape[0]):
        kept = np.flatnonzero(np.isfinite(scores[b]))
        assert kept.tolist() == hf["kept"][b]
        np.testing.assert_array_equal(kept, np.sort(np.argsort(-logits[b], kind="stable")[:50]))


def test_a_pad_token_that_is_an_eos_infers_no_mask(model):
    """HF's generate infers a mask from the pad token only when the pad token is not an EOS
    (GLM's pad token is its first EOS). Measured: prompt [[211, 211, 5, 6]], eos_token_id [211],
    pad_token_id 211, no mask -> new tokens [148, 225, 4, 138, 184, 150]: the 211s are attended.
    Masking them gives [186, 142, 105, 65, 185, 72]."""
    out, _ = _assert_greedy_case(model, "pad_is_eos_without_mask")
    assert out.sequences.numpy()[0, 4:].tolist() == [148, 225, 4, 138, 184, 150]


def test_min_length_counts_the_prompt(model):
    """HF's min_length is a total length, prompt included. Measured: 6-token prompts (one left-padded),
    min_length 9, eos_token_id [240, 211, 172]: the EOS ids are masked for the first 3 new tokens only
    (253 finite scores, then 256), and row 0 ends with EOS 240 as its 5th new token:
    [156, 252, 239, 175, 240, 0]. Holding EOS back for 9 new tokens gives [156, 252, 239, 175, 50, 147]."""
    out, _ = _assert_greedy_case(model, "min_length_counts_the_prompt")
    assert out.sequences.numpy()[0, 6:].tolist() == [156, 252, 239, 175, 240, 0]


def test_min_new_tokens_allows_eos_at_exactly_that_step(model):
    """HF masks the EOS while fewer than min_new_tokens tokens are new, and no longer. Measured: prompt
    [5, 6, 7, 8, 5, 6, 5], greedy new tokens [99, 226, 226, 165, ...]; with eos_token_id [165] and
    min_new_tokens 3 the EOS is masked at steps 0-2 (255 finite scores) and allowed at step 3, where it
    is chosen: the row ends [99, 226, 226, 165]."""
    out, hf = _assert_greedy_case(model, "min_new_tokens_boundary")
    assert hf["kwargs"]["min_new_tokens"] == 3 and out.sequences.numpy()[0, 7:].tolist() == [99, 226, 226, 165]


def test_repetition_penalty_skips_left_padding(model):
    """HF's repetition penalty leaves a row's left padding out (prompt_ignore_length). Measured: rows
    [0, 0, 5, 6, 7, 8] (first two masked) and [9 .. 14], pad_token_id 0 (no real token is 0), penalty
    2.0: the step-0 processed scores at tokens 0 and 5..14 are the fixture's; token 0 of row 0 keeps its
    raw logit -0.70269 (penalised it would be -1.40538), tokens 5..8 are penalised."""
    out, hf = _assert_greedy_case(model, "repetition_penalty_left_padding")
    got = out.scores[0].numpy()[:, hf["columns"]]
    np.testing.assert_allclose(got, hf["scores"], rtol=1e-4, atol=1e-5)
    raw = out.logits[0].numpy()[0]
    np.testing.assert_allclose(got[0, 0], raw[0], rtol=1e-6)  # the pad id: not penalised


def test_a_derived_generation_config_is_saved_as_hf(tmp_path):
    """A folder without generation_config.json: HF derives one from config.json and saves it. Measured,
    with config.json carrying output_scores true and bos_token_id, max_new_tokens, num_beam_groups,
    watermarking_config and cache_config null: {_from_model_config, eos_token_id [1, 2], output_scores
    true, pad_token_id 0, return_dict_in_generate true, transformers_version, use_cache true}: an
    output_* flag sets return_dict_in_generate, and null keys are left out."""
    derived = HF["derived_generation_config"]
    folder = tmp_path / "ckpt"
    shutil.copytree(CKPT, folder)
    cfg = json.loads((folder / "config.json").read_text()) | derived["config_edits"]
    (folder / "config.json").write_text(json.dumps(cfg))
    GlmMoeDsaForCausalLM.from_pretrained(folder, dtype="float32").save_pretrained(tmp_path / "saved")
    saved = json.loads((tmp_path / "saved" / "generation_config.json").read_text())
    assert saved == derived["saved"]
    assert saved["return_dict_in_generate"] is True and None not in saved.values()


def test_beam_search_breaks_exact_ties_as_hf(model):
    """HF's beam search takes its candidates with torch.topk over [batch, beams x vocab]; with three EOS
    ids it keeps 4 x 3 = 12 of 3 x 256 (k x 64 = n), where torch's and Paddle's CPU top-k order equal
    values differently.  Forcing two EOS ids at the last step scores each beam's two continuations
    exactly alike.  Measured: prompt [[23, 9]], 3 beams, eos [82, 100, 153], forced EOS [153, 204]:
    HF returns [23, 9, 136, 153]; taking the candidates in Paddle's order returned [23, 9, 136, 204]
    (3 of 60 random prompts differed so)."""
    out, _ = _assert_greedy_case(model, "beam_forced_eos_tie")
    assert out.sequences.numpy().tolist() == [[23, 9, 136, 153]]

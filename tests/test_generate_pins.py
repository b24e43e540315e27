"""`generate` options pinned to HF transformers 5.23's measured behaviour, without torch.

tests/fixtures/generate/tiny_options.json (written by tools/make_reference.py) holds HF's `generate`
on the committed "tiny" checkpoint for each case below: the prompt, the keywords, the sequences (greedy
and beam search cases; beam search's sequence scores too), each step's count of finite processed scores
per row, and case extras (a logits_processor or prefix_allowed_tokens_fn the case passes); and the
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


def _hooks(hf: dict, vocab: int) -> dict:
    """The case's callables, as tools/make_reference.py passes them to HF: "tied": n, a logits_processor
    leaving the first n tokens at 0 and the rest at -inf; "prefix_allowed": a prefix_allowed_tokens_fn
    allowing rule["allowed"] to a row of rule["length"] tokens ending with rule["last"], all else every id."""
    hooks = {}
    if "tied" in hf:
        tied = paddle.arange(vocab) < hf["tied"]
        hooks["logits_processor"] = [
            lambda ids, x: paddle.where(tied, paddle.zeros_like(x), paddle.full_like(x, -np.inf))
        ]
    if "prefix_allowed" in hf:
        rule, every = hf["prefix_allowed"], list(range(vocab))
        hooks["prefix_allowed_tokens_fn"] = lambda b, sent: (
            rule["allowed"] if len(sent) == rule["length"] and int(sent[-1]) == rule["last"] else every
        )
    return hooks


def _run(model, case: str):
    """This package's generate on the case's prompt and keywords, with HF's record of the case."""
    hf = HF["cases"][case]
    mask = hf["attention_mask"]
    out = model.generate(
        paddle.to_tensor(hf["input_ids"]),
        None if mask is None else paddle.to_tensor(mask),
        **hf["kwargs"],
        **_hooks(hf, model.config.vocab_size),
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
    if "sequences_scores" in hf:
        np.testing.assert_allclose(out.sequences_scores.numpy(), hf["sequences_scores"], rtol=1e-4, atol=1e-5)
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


def test_top_p_drops_tied_tokens_whose_sum_reaches_one_minus_top_p(model):
    """HF's TopPLogitsWarper drops tokens, least likely first, while their summed probability is <= 1 -
    top_p (a sum equal to it goes). Measured: a logits_processor leaving 4 tokens tied at 0 (the rest
    -inf), do_sample, top_k 0, top_p 0.75: 3 finite scores (the first tie's 0.25 == 1 - 0.75 is dropped).
    Dropping only below 1 - top_p keeps all 4."""
    _, finite, hf = _run(model, "top_p_tied_boundary")
    assert finite == hf["finite_per_step"] == [[3]]


def test_min_p_keeps_tokens_tied_with_the_top(model):
    """HF's MinPLogitsWarper drops a token whose probability is below min_p x the top one, not equal to
    it. Measured: 4 tokens tied at 0 (the rest -inf), do_sample, top_k 0, min_p 1.0: all 4 kept.
    Dropping those <= min_p x top keeps only 1 (min_tokens_to_keep)."""
    _, finite, hf = _run(model, "min_p_tied_top")
    assert finite == hf["finite_per_step"] == [[4]]


def test_beam_sampling_top_p_keeps_one_plus_the_eos_count(model):
    """HF's beam sampling passes min_tokens_to_keep = 1 + #EOS to its warpers. Measured: prompt
    [5, 6, 7, 8, 5, 6, 5], num_beams 2, do_sample, top_k 0, top_p 0.01 (which alone keeps 1), eos [211]:
    2 finite scores per beam at each of the 3 steps. Keeping 1 gives [1, 1]."""
    _, finite, hf = _run(model, "beam_sample_top_p_keeps_eos_count")
    assert finite == hf["finite_per_step"] == [[2, 2]] * 3


def test_the_eos_boost_leaves_a_held_back_eos_at_minus_inf(model):
    """HF's ExponentialDecayLengthPenalty lifts the EOS score by |score| (factor^n - 1), and min_new_tokens
    sets it to -inf before: measured, do_sample, min_new_tokens 3, exponential_decay_length_penalty
    [0, 1.5], eos [211]: 4 steps of 50 finite scores (HF's default top_k 50), EOS -inf at steps 0-2.
    Lifting -inf by +inf gives NaN, and sampling then found no valid token (RuntimeError)."""
    out, finite, hf = _run(model, "decay_with_min_new_tokens")
    assert finite == hf["finite_per_step"] == [[50]] * 4
    for s in out.scores[:3]:
        assert np.isneginf(s.numpy()[:, 211]).all()
    assert not any(np.isnan(s.numpy()).any() for s in out.scores)


def test_sequence_biases_on_one_token_add_up(model):
    """HF's SequenceBiasLogitsProcessor adds every bias whose sequence ends a row (index_add_): measured,
    prompt [5, 6, 7, 8, 5, 6], sequence_bias [[6, 99], 2.0], [[5, 6, 99], 3.0], [[99], 1.0]: token 99's
    step-0 score is its logit + 6.0 (7.04479); tokens 98 and 100 are unbiased. Writing the biases
    instead of adding them (index_put without accumulate) scored 99 3.0 lower."""
    out, hf = _assert_greedy_case(model, "sequence_biases_add_up")
    got = out.scores[0].numpy()[:, hf["columns"]]
    np.testing.assert_allclose(got, hf["scores"], rtol=1e-4, atol=1e-5)
    raw = out.logits[0].numpy()[0, hf["columns"]]
    np.testing.assert_allclose(got[0] - raw, [0.0, 6.0, 0.0], atol=1e-5)


def test_guidance_scale_one_is_no_guidance(model):
    """HF adds its classifier-free guidance processor only for guidance_scale != 1. Measured: prompt
    [5, 6, 7, 8, 5, 6, 5], greedy, guidance_scale 1.0, 3 steps: tokens [99, 226, 226] and the scores
    are the raw logits (the fixture's columns). Guidance at scale 1 returns log-softmaxed scores."""
    out, hf = _assert_greedy_case(model, "guidance_scale_one_is_off")
    got = out.scores[0].numpy()[:, hf["columns"]]
    np.testing.assert_allclose(got, hf["scores"], rtol=1e-4, atol=1e-5)
    for s, raw in zip(out.scores, out.logits):
        np.testing.assert_array_equal(s.numpy(), raw.numpy())


def test_an_unmet_prefix_rule_is_judged_per_prompt(model):
    """HF's PrefixConstrainedLogitsProcessor gives the allowed tokens score 0 only when every beam of a
    prompt has all its allowed tokens at -inf. Measured: prompt [5, 6, 7, 8, 5, 6, 5], 2 beams,
    bad_words_ids [[9]], prefix_allowed_tokens_fn -> [9] for the beam ending in 99 at step 1, else all:
    that beam stays all -inf (finite [0, 255] at step 1) and HF returns [..., 226, 226, 226]. Judging
    the beam alone gave finite [1, 256] and [..., 99, 9, 240]."""
    out, hf = _assert_greedy_case(model, "prefix_unmet_in_one_beam")
    assert hf["finite_per_step"][1] == [0, 255]
    assert out.sequences.numpy()[0, 7:].tolist() == [226, 226, 226]


def test_early_stopping_never_searches_to_the_end(model):
    """HF's early_stopping "never" ends a prompt's beam search only when no running beam can beat the
    worst finished one, never for having num_beams finished. Measured: prompt [219, 143, 11], 3 beams,
    eos [211, 240, 156, 252, 226], max_new_tokens 6, num_return_sequences 3: the best is
    [..., 128, 140, 183, 207, 201, 162] (score -3.31809). Treating "never" as True returned
    [..., 211, 211, 211, 211, 211] first."""
    out, hf = _assert_greedy_case(model, "beam_never_stops_early")
    assert out.sequences.numpy()[0, 3:].tolist() == [128, 140, 183, 207, 201, 162]


def test_early_stopping_never_with_a_negative_length_penalty_runs_every_step(model):
    """With early_stopping "never" and length_penalty <= 0 HF judges the best running beam at the current
    length (not the maximum one). Measured: the case above with length_penalty -1.0: 6 steps of scores
    and the fixture's sequences. Judging it at the maximum length stopped after 5."""
    out, hf = _assert_greedy_case(model, "beam_never_negative_length_penalty")
    assert len(out.scores) == len(hf["finite_per_step"]) == 6


def test_early_stopping_true_freezes_a_done_prompt_in_a_batch(model):
    """HF's early_stopping True: once a prompt has num_beams finished hypotheses, it takes no new one
    (other prompts of the batch run on). Measured: prompts [[25, 221], [8, 139]], 2 beams, eos [211, 240,
    156, 252, 226, 165, 99, 128], max_new_tokens 6, num_return_sequences 2: prompt 0's second hypothesis
    is [25, 221, 12, 157, 125, 240, 211, 211] (-3.44087). Letting it take later ones gave
    [25, 221, 12, 157, 24, 175, 240, 211] (-3.31950)."""
    out, hf = _assert_greedy_case(model, "beam_early_stopping_batch")
    assert out.sequences.numpy()[1].tolist() == [25, 221, 12, 157, 125, 240, 211, 211]


def test_a_stop_string_inside_the_prompt_alone_does_not_stop(tmp_path):
    """HF's StopStringCriteria needs a match that ends at the sequence's end and overlaps a new token.
    Measured, transformers 5.23 on make_tiny_checkpoint() with its tokenizer, prompt "The capital of
    France is", greedy, max_new_tokens 6, no EOS (free text 'ce' 'g' '.' ' this' ...): stop
    "is" -> 4 new tokens (" this"), "France is" (wholly in the prompt) -> all 6. Searching one character
    further into the prompt stopped both after 1."""
    from paddleformers_glm.tiny import make_tiny_checkpoint
    from paddleformers_glm.tokenizer import GlmTokenizer

    folder = make_tiny_checkpoint(tmp_path / "ckpt")
    model, tok = GlmMoeDsaForCausalLM.from_pretrained(folder, dtype="float32"), GlmTokenizer.from_pretrained(folder)
    ids = paddle.to_tensor([tok.encode("The capital of France is")])
    for stop, n in (("is", 4), ("France is", 6)):
        out = model.generate(ids, max_new_tokens=6, eos_token_id=[], stop_strings=[stop], tokenizer=tok)
        assert out.shape[1] - ids.shape[1] == n, (stop, tok.decode(out.numpy()[0, ids.shape[1] :]))

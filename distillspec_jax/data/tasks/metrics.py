"""seqio metric functions: plain functions of (targets, predictions) -> dict.

Scores are percentages (0-100) as in T5, except ``log_perplexity`` (nats/token).
Pure Python/NumPy: no TensorFlow needed to call them.
"""

from __future__ import annotations

import re
from typing import Any, Callable, Mapping, Optional, Sequence

import numpy as np

# ---------------------------------------------------------------- extraction
_NUMBER_RE = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")


def _normalize_number(text: str) -> Optional[str]:
  """'1,234.' -> '1234'; '$18.00' -> '18'; returns None if no number."""
  text = text.replace(",", "").replace("$", "").strip()
  m = re.search(r"-?\d+(?:\.\d+)?|-?\.\d+", text)
  if not m:
    return None
  value = float(m.group(0))
  if value == int(value) and abs(value) < 1e15:
    return str(int(value))
  return repr(value)


def extract_gsm8k_answer(text: str) -> Optional[str]:
  """Final answer of a GSM8K-style solution, normalized.

  The number after the last '####' if present, else the last number in the
  text.  Commas, '$' and a trailing period are ignored: '#### 1,234.' -> '1234'.
  """
  if text is None:
    return None
  if isinstance(text, bytes):
    text = text.decode("utf-8")
  if "####" in text:
    after = text.rsplit("####", 1)[1]
    ans = _normalize_number(after)
    if ans is not None:
      return ans
  numbers = _NUMBER_RE.findall(text)
  if not numbers:
    return None
  return _normalize_number(numbers[-1])


_BBH_OPTION_RE = re.compile(r"\(([A-Z])\)")


def extract_bbh_answer(text: str) -> str:
  """The answer in a BBH chain-of-thought output (or a plain BBH target).

  Takes the text after the last 'answer is' (if present; otherwise the last
  non-empty line), keeps its first line, strips whitespace, a trailing period
  and surrounding quotes.  A multiple-choice answer starting with an option
  such as '(B)' or '(B) blue' is reduced to '(B)'.
  """
  if isinstance(text, bytes):
    text = text.decode("utf-8")
  idx = text.lower().rfind("answer is")
  if idx >= 0:
    answer = text[idx + len("answer is"):].lstrip(" :")
    answer = answer.strip().split("\n")[0]
  else:
    lines = [l for l in text.strip().split("\n") if l.strip()]
    answer = lines[-1] if lines else ""
  answer = answer.strip().rstrip(".").strip()
  if len(answer) >= 2 and answer[0] == answer[-1] and answer[0] in "\"'`":
    answer = answer[1:-1].strip()
  option = _BBH_OPTION_RE.match(answer)
  if option:
    return f"({option.group(1)})"
  return answer


# ---------------------------------------------------------------- metrics
def _as_str(x: Any) -> str:
  if isinstance(x, bytes):
    return x.decode("utf-8")
  return str(x)


def _check_lengths(targets: Sequence[Any], predictions: Sequence[Any]) -> None:
  if len(targets) != len(predictions):
    raise ValueError(
        f"targets and predictions differ in length: {len(targets)} vs "
        f"{len(predictions)}; pass one prediction per target.")


def rouge(targets: Sequence[str], predictions: Sequence[str],
          score_keys: Sequence[str] = ("rouge1", "rouge2", "rougeL"),
          use_stemmer: bool = True) -> dict:
  """Mean ROUGE F-measure (x100) per key, computed with rouge-score."""
  from rouge_score import rouge_scorer  # pylint: disable=g-import-not-at-top

  _check_lengths(targets, predictions)
  scorer = rouge_scorer.RougeScorer(list(score_keys), use_stemmer=use_stemmer)
  totals = {k: 0.0 for k in score_keys}
  for t, p in zip(targets, predictions):
    s = scorer.score(_as_str(t), _as_str(p))
    for k in score_keys:
      totals[k] += s[k].fmeasure
  n = max(len(targets), 1)
  return {k: 100.0 * v / n for k, v in totals.items()}


def bleu(targets: Sequence[str], predictions: Sequence[str]) -> dict:
  """Corpus BLEU with sacrebleu's defaults (13a tokenization, exp smoothing)."""
  import sacrebleu  # pylint: disable=g-import-not-at-top

  _check_lengths(targets, predictions)
  refs = [_as_str(t) for t in targets]
  hyps = [_as_str(p) for p in predictions]
  result = sacrebleu.corpus_bleu(hyps, [refs])
  return {"bleu": float(result.score)}


def gsm8k_accuracy(targets: Sequence[str], predictions: Sequence[str]) -> dict:
  """% of predictions whose final number equals the target's.

  The final number is the one after '####' or else the last number; commas and
  a trailing period are ignored, so '#### 1,234.' matches '1234'.
  """
  _check_lengths(targets, predictions)
  correct = 0
  for t, p in zip(targets, predictions):
    ta, pa = extract_gsm8k_answer(_as_str(t)), extract_gsm8k_answer(_as_str(p))
    correct += int(ta is not None and ta == pa)
  return {"accuracy": 100.0 * correct / max(len(targets), 1)}


def bbh_exact_match(targets: Sequence[str], predictions: Sequence[str]) -> dict:
  """% exact match after extracting the answer from both (see extract_bbh_answer)."""
  _check_lengths(targets, predictions)
  correct = 0
  for t, p in zip(targets, predictions):
    correct += int(extract_bbh_answer(_as_str(t)) == extract_bbh_answer(_as_str(p)))
  return {"exact_match": 100.0 * correct / max(len(targets), 1)}


def log_perplexity(targets: Sequence[Any], scores: Sequence[Any]) -> dict:
  """Per-token log-perplexity: -sum(log-likelihood) / number of target tokens.

  Two accepted forms:
    * ``scores[i]`` is an array of per-token log-probabilities: its length is
      the token count (``targets`` are then only used for the length check);
    * ``scores[i]`` is a scalar total log-likelihood: ``targets[i]`` must be
      the target token ids (a sequence of ints, padding 0 excluded) or an int
      token count.
  Returns {'log_perplexity': nats per token, 'num_tokens': int}.
  """
  _check_lengths(targets, scores)
  total, count = 0.0, 0
  for t, s in zip(targets, scores):
    s_arr = np.asarray(s, dtype=np.float64)
    if s_arr.ndim >= 1:
      total += float(s_arr.sum())
      count += int(s_arr.size)
      continue
    if isinstance(t, (int, np.integer)):
      n = int(t)
    elif isinstance(t, (str, bytes)):
      raise ValueError(
          "log_perplexity got a string target with a scalar score; pass the "
          "target token ids (or token counts) as targets, per-token scores, or "
          "use make_log_perplexity(vocabulary) to count tokens of strings.")
    else:
      n = int(np.count_nonzero(np.asarray(t)))
    total += float(s_arr)
    count += n
  if count == 0:
    raise ValueError("log_perplexity: no target tokens to average over.")
  return {"log_perplexity": -total / count, "num_tokens": count}


def make_log_perplexity(vocabulary, add_eos: bool = True) -> Callable[..., dict]:
  """log_perplexity whose string targets are tokenized with `vocabulary` (+EOS)."""

  def log_perplexity_fn(targets, scores):
    counts = []
    for t in targets:
      if isinstance(t, (str, bytes)):
        counts.append(len(vocabulary.encode(_as_str(t))) + int(add_eos))
      else:
        counts.append(t)
    return log_perplexity(counts, scores)

  log_perplexity_fn.__name__ = "log_perplexity"
  return log_perplexity_fn


def lm_target_token_ids(output: Any, example: Optional[Mapping[str, Any]] = None,
                        is_target: bool = False) -> Any:
  """seqio postprocess_fn for LM tasks: targets become their token ids.

  With it, seqio passes token-id targets to `log_perplexity` (score metric).
  """
  if is_target and example is not None and "targets" in example:
    return np.asarray(example["targets"])
  return output

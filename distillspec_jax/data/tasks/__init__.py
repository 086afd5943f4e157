"""seqio tasks of distillspec_jax, registered on demand (importing registers nothing).

`ensure_default_tasks()` registers these once (cheap: no file reads, no vocabulary loads;
`batches.get_task` calls it):
  * TFDS-backed: xsum, cnn_dailymail, gsm8k, wmt14_en_de, lm1b (T5's public
    SentencePiece vocabulary), see tfds_tasks.py;
  * embedded_arithmetic: procedurally generated arithmetic word problems, the
    demo's default, with its own small vocabulary (embedded.py).
Registered on request, with a data directory (the binaries pass gin's DATA_DIR):
  * register_file_tasks(data_dir) -> gsm8k_files, xsum_files,
    cnn_dailymail_files, wmt_en_de_files, lm1b_files (+ BBH if data_dir/bbh);
  * register_bbh_tasks(bbh_dir) -> bbh_<subtask> tasks and the 'bbh' mixture;
  * register_file_tasks(data_dir, vocabulary, chat_template=True) -> also chat_files
    (data_dir/chat/ conversations), every task rendered by the tokenizer's chat template
    (chat_tasks.py).

Decoder-only use: tasks with 'inputs' and 'targets' become a prefix LM with
seqio.DecoderFeatureConverter(pack=False) and lengths for both features
(distillspec_jax.data.batches.get_dataset(..., feature_converter='decoder')).
"""

import seqio

from distillspec_jax.data.tasks import metrics
from distillspec_jax.data.tasks import preprocessors
from distillspec_jax.data.tasks import tfds_tasks
from distillspec_jax.data.tasks import embedded
from distillspec_jax.data.tasks import file_tasks
from distillspec_jax.data.tasks import bbh
from distillspec_jax.data.tasks import chat_tasks

from distillspec_jax.data.tasks.bbh import register_bbh_tasks
from distillspec_jax.data.tasks.embedded import (DEFAULT_SEQUENCE_LENGTHS as EMBEDDED_SEQUENCE_LENGTHS,
                                            TASK_NAME as EMBEDDED_TASK_NAME,
                                            build_embedded_vocabulary, embedded_vocabulary,
                                            generate_examples as generate_embedded_examples,
                                            register_embedded_task)
from distillspec_jax.data.tasks.file_tasks import (register_chat_files,
                                              register_cnn_dailymail_files, register_file_tasks,
                                              register_gsm8k_files, register_lm1b_files,
                                              register_wmt_files, register_xsum_files)
from distillspec_jax.data.tasks.tfds_tasks import TFDS_TASK_NAMES, register_tfds_tasks


_DEFAULTS_REGISTERED = False


def ensure_default_tasks() -> None:
  """Registers the default tasks once per process, leaving any registered under the same
  name before (say, the embedded task with a run's own vocabulary) as they are."""
  global _DEFAULTS_REGISTERED
  if _DEFAULTS_REGISTERED:
    return
  registered = set(seqio.TaskRegistry.names())
  if not registered & set(TFDS_TASK_NAMES):
    register_tfds_tasks()
  if EMBEDDED_TASK_NAME not in registered:
    register_embedded_task()
  _DEFAULTS_REGISTERED = True

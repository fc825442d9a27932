"""A corpus of classic TF1 training programs and the harness that judges replicate on them.

Each program module (one per program, written in the idiom of 2016-2018 TF1 code) defines:

- ``FAMILY``, ``DESCRIPTION``, ``DRIVER``: one-line texts for ``docs/corpus.md``;
- ``BATCHES``: the global batch sizes it is run with (the first splits evenly over 1, 2 and
  3 towers, the second does not where the program allows);
- ``VARIANTS``: variant name -> ``{"build": kwargs, "data": kwargs, "drive": kwargs,
  "options": transform kwargs, "expect": what the mathematics allows}``; the first is the
  primary variant. ``expect`` is ``{"exact": True}`` or ``{"exact": False, "reasons_only":
  [substrings]}`` (every reason of the report must name one of them), optionally with
  ``"max_diff"`` (the numeric agreement expected even though inexactness is reported, e.g.
  dropout fed ``keep_prob=1.0``) and ``"why"`` (a sentence for the docs);
- ``build(batch_size, **kwargs) -> dict``: builds the graph in the default graph and returns
  the names a driver uses (tensor and op names only) plus ``"saver"`` (the ``tf.train.Saver``
  the legacy program creates; its ``export_meta_graph`` is what the legacy program writes);
- ``make_data(rng, batch_size, steps, **kwargs)``: deterministic synthetic data;
- ``drive(sess, graph, names, data, workdir, **kwargs) -> list[(label, value)]``: the
  family's legacy driver loop, written against names only; returns what it fetched.

``harness.py`` runs one program (API and ``replicate convert`` paths, 1-3 towers) and
prints JSON records; ``report.py`` runs them all and writes ``docs/corpus.md``.
"""

#: Program modules, in the order of the docs table.
PROGRAMS = [
    "cifar10_tutorial",
    "ptb_word_lm",
    "char_rnn",
    "dcgan",
    "nmt_attention",
    "text_cnn",
    "word2vec_skipgram",
    "resnet_layers",
    "stateful_lstm",
    "autoencoder",
    "sequence_tagger",
    "gcn",
    "transformer",
    "bilstm_crf",
    "pix2pix",
    "rnn_from_scratch",
]

__all__ = ["PROGRAMS"]

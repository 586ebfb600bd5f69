"""The reference training job for loka-torchrec: TorchRec DMP with LoKA by one flag.

Not part of the library (``loka_torchrec`` never imports it): a Hydra recipe app
(``python -m loka_job.train`` / ``loka-train``, recipes in ``recipes/``), synthetic click and
sequence data with a learnable teacher, the DLRM/DCN (TorchRec's), DHEN- and HSTU-style models,
metrics, other libraries' FP8 training as baselines (``loka_job.baselines``) and the trainer that
runs them all (``loka_job.training.trainer``). It uses LoKA the way any TorchRec job does, through
:func:`loka_torchrec.prepare`. Install it with the ``job`` extra (Hydra, torchmetrics, tqdm).
"""

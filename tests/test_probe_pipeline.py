"""ProbedTrainPipeline: TorchRec's TrainPipelineSparseDist under DMP (gloo, CPU) driving the Probe."""

import pytest
import torch
import torch.distributed as dist
from torch import nn

from loka_torchrec.probe import ProbeCallback, ProbeConfig
from loka_torchrec.probe.logs import read_rank_log

B, DENSE, DIM = 16, 4, 8


def _batches(n):
    from torchrec import KeyedJaggedTensor
    from torchrec.datasets.utils import Batch

    gen = torch.Generator().manual_seed(0)
    for _ in range(n):
        kjt = KeyedJaggedTensor.from_lengths_sync(
            keys=["f0"], values=torch.randint(0, 100, (2 * B,), generator=gen), lengths=torch.full((B,), 2)
        )
        yield Batch(dense_features=torch.randn(B, DENSE, generator=gen), sparse_features=kjt, labels=torch.randint(0, 2, (B,), generator=gen).float())


class _TinyRec(nn.Module):
    def __init__(self):
        super().__init__()
        from torchrec import EmbeddingBagCollection, EmbeddingBagConfig

        tables = [EmbeddingBagConfig(name="t0", embedding_dim=DIM, num_embeddings=100, feature_names=["f0"])]
        self.ebc = EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
        self.dense = nn.Linear(DENSE, DIM)
        self.over = nn.Linear(2 * DIM, 1)

    def forward(self, batch):
        pooled = self.ebc(batch.sparse_features).values()
        logits = self.over(torch.cat([self.dense(batch.dense_features), pooled], dim=1)).squeeze(1)
        loss = nn.functional.binary_cross_entropy_with_logits(logits, batch.labels)
        return loss, (loss.detach(), logits.detach(), batch.labels)


@pytest.mark.slow
def test_probed_pipeline_under_dmp(tmp_path):
    pytest.importorskip("torchrec")
    from torchrec.distributed import DistributedModelParallel

    from loka_torchrec.probe import ProbedTrainPipeline

    if dist.is_initialized():
        pytest.skip("a default process group already exists in this process")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = DistributedModelParallel(_TinyRec(), device=torch.device("cpu"))
        cfg = ProbeConfig(enabled=True, every=2, warmup_steps=4, every_after=2, monitor_budget=0.0, samples=2, speed_reps=1, max_rows_per_step=16)
        probe = ProbeCallback(model, cfg, run_dir=str(tmp_path))
        assert probe.layer_names == ["dense", "over"]  # DMP/DDP prefixes stripped
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        pipeline = ProbedTrainPipeline(model, optimizer, torch.device("cpu"), probe=probe)
        batches = _batches(6)
        steps = 0
        while True:
            try:
                pipeline.progress(batches)
                steps += 1
            except StopIteration:
                break
        probe.close()
    finally:
        dist.destroy_process_group()
        torch.set_num_threads(threads)
    assert steps == pipeline.step == 6 and probe.planned
    records, problems = read_rank_log(tmp_path / "probe" / "rank0.jsonl")
    assert not problems
    dense = [r for r in records if r["layer"] == "dense" and r["event"] != "plan"]
    assert [r["step"] for r in dense] == [0, 2, 4]
    assert all(r["stats"]["act"]["merged"]["rows"] == B and r["stats"]["grad"]["merged"]["rows"] == B for r in dense)
    with pytest.raises(TypeError, match="probe: expected a ProbeCallback"):
        ProbedTrainPipeline(model, optimizer, torch.device("cpu"), probe=None)

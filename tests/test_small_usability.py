"""Issue 38's smaller items: a misspelled keyword names ``KFAC``, not the shared body; K-FAC's setup warnings (a
tied embedding, skipped layers) show on rank 0 only; the summary says when K-FAC's phases run on fewer threads
than torch's setting."""

from __future__ import annotations

import logging
import warnings

import pytest
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from helpers.lightning_models import Tiny, trainer
from pytorch_lightning.strategies import SingleDeviceStrategy
from torch import nn

from lightning_spdkfac import KFAC
from lightning_spdkfac.lightning.run_report import thread_note


def test_a_misspelled_keyword_names_kfac():
    with pytest.raises(TypeError) as e:
        KFAC(dampin=0.1)
    assert str(e.value) == "KFAC.__init__() got an unexpected keyword argument 'dampin'"
    unified = pytest.importorskip("lightning_spdkfac.unified")
    with pytest.raises(TypeError, match=r"^KFAC\.__init__\(\) got an unexpected keyword argument 'dampin'$"):
        unified.KFAC(dampin=0.1)


class TiedLM(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 6)
        self.head = nn.Linear(6, 10, bias=False)
        self.head.weight = self.emb.weight

    def training_step(self, batch, _):
        x = torch.arange(10).repeat(2)
        return F.cross_entropy(self.head(self.emb(x)), x)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.zeros(4, 1), batch_size=2)


def _setup_warnings(global_zero: bool, monkeypatch) -> list[str]:
    monkeypatch.setattr(SingleDeviceStrategy, "is_global_zero", property(lambda self: global_zero))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer(max_steps=1, callbacks=[KFAC(summary=False)]).fit(TiedLM())
    return [str(w.message) for w in caught if "tied to 'head'" in str(w.message)]


def test_the_tied_weight_warning_shows_on_rank_0_only(monkeypatch):
    assert len(_setup_warnings(True, monkeypatch)) == 1
    assert _setup_warnings(False, monkeypatch) == []  # another rank: the same model, the same warning, not repeated


def test_the_summary_says_when_kfac_runs_on_fewer_threads(caplog, monkeypatch):
    monkeypatch.delenv("SPDKFAC_KFAC_THREADS", raising=False)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert thread_note(1) == ("\nK-FAC threads: its own phases run on 1 of torch's 2 intra-op threads "
                                  "(SPDKFAC_KFAC_THREADS=N sets the cap, 0 removes it; docs/guide/threads.md)")
        assert thread_note(None) == thread_note(2) == ""
        with caplog.at_level(logging.INFO):
            trainer(max_steps=1, callbacks=[KFAC()]).fit(Tiny())
        (summary,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("K-FAC summary")]
        assert summary.endswith(thread_note(1))
        torch.set_num_threads(1)
        assert thread_note(1) == ""
    finally:
        torch.set_num_threads(before)


def test_a_misspelled_strategy_keyword_is_refused_at_construction_with_the_nearest_name():
    from lightning_spdkfac import SPDKFACStrategy

    with pytest.raises(TypeError) as e:
        SPDKFACStrategy(schedul="mpd")  # went to DDP's kwargs before, to fail (or not) when the model is wrapped
    assert str(e.value) == ("SPDKFACStrategy() got an unexpected keyword argument 'schedul': neither a strategy argument "
                            "nor one of DDPStrategy's or DistributedDataParallel's; did you mean 'schedule'?")
    with pytest.raises(TypeError, match="'fnd_unused_parameters'.*did you mean 'find_unused_parameters'"):
        SPDKFACStrategy(fnd_unused_parameters=True)
    # DDPStrategy's and DistributedDataParallel's own keywords still pass through
    SPDKFACStrategy(find_unused_parameters=True, static_graph=False, start_method="popen", ddp_comm_hook=None)

"""Train the handwritten-digits classifier as a PyTorch Lightning module on spark-hvd.

The LightningModule knows nothing of distribution; ``Trainer(strategy=SparkHvdStrategy())`` does the
rest. Run it on two processes, or alone:

    spark-hvd-run -np 2 python examples/lightning_train.py
    python examples/lightning_train.py

Each rank trains on its shard of the training rows (the strategy gives the dataloaders a
DistributedSampler), every rank starts from rank 0's parameters, gradients are averaged while
backward runs, the logged metrics are averaged across ranks (``sync_dist=True``), and only rank 0
writes checkpoints (``--checkpoint-dir``; ``--resume`` continues from the last one). The learning
rate is scaled by the number of ranks, as the global batch grows with it. The data (scikit-learn's
digits set, shipped inside the package), its split and the network are those of
examples/pytorch_train.py, which this script imports from beside it.
"""

import argparse
import json

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from pytorch_lightning.callbacks import Callback, ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

from pytorch_train import make_model, split_digits  # the Horovod-style example's data split and network
from spark_hvd.lightning import SparkHvdStrategy


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=20, help="passes over the training rows")
    parser.add_argument("--batch-size", type=int, default=32, help="rows per rank per step")
    parser.add_argument("--lr", type=float, default=0.02, help="learning rate of one process; scaled by size")
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--accelerator", default="cpu", choices=["cpu", "gpu", "auto"])
    parser.add_argument("--checkpoint-dir", default=None, help="rank 0 saves a checkpoint here after every epoch")
    parser.add_argument("--resume", action="store_true", help="continue from the last checkpoint in --checkpoint-dir")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--result-json", default=None, help="rank 0 writes the final metrics here")
    return parser.parse_args()


class DigitsClassifier(pl.LightningModule):
    """A small MLP over the 8x8 digit images, trained with momentum SGD."""

    def __init__(self, lr, momentum):
        super().__init__()
        self.save_hyperparameters()
        self.net = make_model()

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        features, labels = batch
        loss = F.cross_entropy(self(features), labels)
        self.log("train_loss", loss, on_step=False, on_epoch=True, sync_dist=True)
        return loss

    def _evaluate(self, batch, stage):
        features, labels = batch
        logits = self(features)
        self.log(f"{stage}_loss", F.cross_entropy(logits, labels), sync_dist=True)
        self.log(f"{stage}_acc", (logits.argmax(dim=1) == labels).float().mean(), sync_dist=True)

    def validation_step(self, batch, batch_idx):
        self._evaluate(batch, "val")

    def test_step(self, batch, batch_idx):
        self._evaluate(batch, "test")

    def configure_optimizers(self):
        lr = self.hparams.lr * self.trainer.world_size
        return torch.optim.SGD(self.parameters(), lr=lr, momentum=self.hparams.momentum)


class PrintProgress(Callback):
    """One line per epoch from rank 0, with metrics already averaged over the ranks."""

    def on_train_epoch_end(self, trainer, module):
        if not trainer.is_global_zero:
            return
        metrics = trainer.callback_metrics
        print(f"epoch {trainer.current_epoch + 1:3d}/{trainer.max_epochs}  "
              f"train loss {metrics['train_loss']:.4f}  test accuracy {metrics['val_acc']:.4f}", flush=True)


def main():
    args = parse_args()
    torch.set_num_threads(args.threads)
    pl.seed_everything(args.seed, verbose=False)

    (train_x, train_y), (test_x, test_y) = split_digits(args.seed)
    train_loader = DataLoader(TensorDataset(train_x, train_y), batch_size=args.batch_size, shuffle=True)
    test_loader = DataLoader(TensorDataset(test_x, test_y), batch_size=256)

    callbacks = [PrintProgress()]
    if args.checkpoint_dir:
        callbacks.append(ModelCheckpoint(dirpath=args.checkpoint_dir, save_last=True, save_top_k=0))
    trainer = pl.Trainer(strategy=SparkHvdStrategy(), accelerator=args.accelerator, devices=1,
                         max_epochs=args.epochs, callbacks=callbacks, logger=False,
                         enable_checkpointing=bool(args.checkpoint_dir), enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0)
    model = DigitsClassifier(lr=args.lr, momentum=args.momentum)
    resume = "last" if args.resume and args.checkpoint_dir else None
    trainer.fit(model, train_loader, test_loader, ckpt_path=resume)

    (metrics,) = trainer.test(model, test_loader, verbose=False)
    if trainer.is_global_zero:
        accuracy = metrics["test_acc"]
        print(f"final test accuracy {accuracy:.4f} with {trainer.world_size} rank(s)", flush=True)
        if args.result_json:
            with open(args.result_json, "w") as out:
                json.dump({"accuracy": accuracy, "size": trainer.world_size, "epochs": args.epochs,
                           "steps": trainer.global_step}, out)


if __name__ == "__main__":
    main()

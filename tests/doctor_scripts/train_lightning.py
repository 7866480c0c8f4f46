"""A Lightning ``fit`` for the doctor's client test: a slow transform makes it data-bound.

The training loader (batch 8) and the validation loader (batch 4, which Lightning's sanity
check iterates first) are plain DataLoaders; each training sample sleeps 10 ms.
"""

import time

import lightning.pytorch as L
import torch
from torch.utils.data import DataLoader, Dataset


class Points(Dataset):
    def __init__(self, n, slow):
        self.n, self.slow = n, slow

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if self.slow:
            time.sleep(0.01)
        return torch.full((4,), float(i)), torch.tensor([float(i % 3)])


class Regression(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch, index):
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def validation_step(self, batch, index):
        x, y = batch
        self.log("val", torch.nn.functional.mse_loss(self.layer(x), y))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def main():
    train = DataLoader(Points(96, slow=True), batch_size=8, shuffle=True, num_workers=2)
    val = DataLoader(Points(16, slow=False), batch_size=4)
    trainer = L.Trainer(max_epochs=3, accelerator="cpu", logger=False,
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=2,
                        limit_val_batches=2)
    trainer.fit(Regression(), train, val)


if __name__ == "__main__":
    main()

"""Train a small JAX model from ShmDataLoader batches (CPU is fine).

Run: python examples/train_jax.py   (needs `pip install jax`)

The batch lifetime rule: batch["image"] views a shared-memory slot. jax.device_put copies
it to the device (on the CPU backend it may alias the numpy buffer until the computation
that uses it is done), so release the batch only after the step that consumes the device
arrays has been dispatched and blocked on: here `with batch:` ends after
`block_until_ready()`.
"""

from __future__ import annotations

import pathlib
import sys
import tempfile

import numpy as np

import jax
import jax.numpy as jnp

from shmloader import ShmDataLoader
from shmloader.demo import CLASSES, IMAGE_SHAPE, make_dataset, write_dataset


def init(key):
    features = int(np.prod(IMAGE_SHAPE))
    k1, k2 = jax.random.split(key)
    return {
        "w1": jax.random.normal(k1, (features, 64)) * 0.02, "b1": jnp.zeros(64),
        "w2": jax.random.normal(k2, (64, CLASSES)) * 0.02, "b2": jnp.zeros(CLASSES),
    }


def forward(params, images):
    x = (images.reshape(images.shape[0], -1).astype(jnp.float32) - 128.0) / 64.0
    hidden = jax.nn.relu(x @ params["w1"] + params["b1"])
    return hidden @ params["w2"] + params["b2"]


def loss_fn(params, images, labels):
    logits = forward(params, images)
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), labels[:, None], axis=1))


@jax.jit
def train_step(params, images, labels):
    loss, grads = jax.value_and_grad(loss_fn)(params, images, labels)
    return jax.tree_util.tree_map(lambda p, g: p - 0.05 * g, params, grads), loss


def main(steps: int = 300, batch_size: int = 256) -> float:
    params = init(jax.random.PRNGKey(0))
    with tempfile.TemporaryDirectory() as directory:
        fields = write_dataset(pathlib.Path(directory))
        # On several hosts: shard_index=jax.process_index(), shard_count=jax.process_count().
        with ShmDataLoader(fields, batch_size=batch_size, readers=2, slots=8, seed=0,
                           shard_index=jax.process_index(), shard_count=jax.process_count()) as loader:
            for step, batch in zip(range(steps), loader):
                with batch:
                    x, y = jax.device_put(batch["image"]), jax.device_put(batch["label"].astype(np.int32))
                    params, loss = train_step(params, x, y)
                    loss.block_until_ready()  # The step has read x and y: the slot may go.
                if step % 100 == 0:
                    print(f"step {step}: loss {float(loss):.3f}")
            print(f"loader: {loader.stats()['rows_per_s']:,.0f} rows/s")
    test_images, test_labels = make_dataset(2_000, seed=1)
    accuracy = float((forward(params, jnp.asarray(test_images)).argmax(axis=1) == test_labels).mean())
    print(f"held-out accuracy {accuracy:.1%} (chance {1 / CLASSES:.0%})")
    return accuracy


if __name__ == "__main__":
    sys.exit(0 if main() > 2 / CLASSES else 1)

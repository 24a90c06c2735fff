"""One process of test_distributed's two-process job: joins it (engine.distributed flags), sums a vector
sharded over every process's devices, agrees on a KV cache size, prints what it saw as JSON."""

import argparse
import json

from pdserve.engine.distributed import add_distributed_args, join, process_group

parser = argparse.ArgumentParser()
add_distributed_args(parser)
join(process_group(parser.parse_args()))

import jax  # noqa: E402  (after join: JAX must not touch a device before it)
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

mesh = Mesh(np.array(jax.devices()), ("model",))
data = np.arange(8, dtype=np.float32)
x = jax.make_array_from_callback((8,), NamedSharding(mesh, P("model")), lambda index: data[index])
total = jax.jit(lambda a: a.sum(), out_shardings=NamedSharding(mesh, P()))(x)
# engine.memory: each process sizes its KV cache from its own memory; all take the smallest
from pdserve.engine.memory import agreed_num_blocks  # noqa: E402

agreed = agreed_num_blocks(100 + 5 * jax.process_index())
out = {
    "process": jax.process_index(),
    "devices": jax.device_count(),
    "sum": float(total),
    "num_blocks": agreed,
}
print(json.dumps(out))

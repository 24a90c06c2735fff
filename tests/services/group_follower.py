"""A worker's side of the group protocol without an engine, for test_group: follows the leader at ADDRESS
as process ID with FINGERPRINT (and the group's SECRET_FILE, if given) and prints each operation as a JSON
line (kind, args, arrays as lists) until `stop`."""

import json
import sys

from pdserve.engine.distributed import ProcessGroup
from pdserve.services.group import operations

address, process_id, fingerprint = sys.argv[1], int(sys.argv[2]), sys.argv[3]
secret_file = sys.argv[4] if len(sys.argv) > 4 else None
host, port = address.rsplit(":", 1)
group = ProcessGroup(f"{host}:1", 8, process_id, group_port=int(port), secret_file=secret_file)
ops = operations(group, fingerprint)
print("following", flush=True)
while True:
    op = ops.get()
    arrays = {k: [a.dtype.name, a.tolist()] for k, a in op.arrays.items()}
    print(json.dumps({"kind": op.kind, "args": op.args, "arrays": arrays}), flush=True)
    if op.kind == "stop":
        break

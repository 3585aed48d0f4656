"""Driver of tests/test_compression_wire.py, run inside `unshare --user --map-root-user
--net`: `python tests/wire_namespace_child.py WORKER [ARG...]`.

Brings the namespace's loopback up (SIOCGIFFLAGS / SIOCSIFFLAGS; no iproute2 needed), then
runs `python WORKER ARG...` as two workers under `tfpar.launch`; exits with its status.
"""

import fcntl
import socket
import struct
import subprocess
import sys

s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
flags = struct.unpack("16sH14x", fcntl.ioctl(s, 0x8913, struct.pack("16sH14x", b"lo", 0)))[1]
fcntl.ioctl(s, 0x8914, struct.pack("16sH14x", b"lo", flags | 1))
sys.exit(subprocess.call([sys.executable, "-m", "tfpar.launch", "--workers=2",
                          "--timeout=300", "--", sys.executable, *sys.argv[1:]]))

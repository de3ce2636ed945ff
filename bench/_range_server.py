"""A read-only S3 stand-in for the benchmarks: HEAD and ranged GET of the files of one
directory, as objects of one bucket, sent with sendfile.

Why: moto copies the whole object twice for every ranged GET (in Python, in the bench's
own process), so a run from it measures moto; s3rver needs node and npm. This server's
cost per byte is the kernel's sendfile, so what a run measures is its client. It answers
what obstore's GET and HEAD read (Content-Length, Content-Range, ETag, Last-Modified) and
honours If-Match (412), as S3 does; it checks no signature and lists nothing. Never for
anything but 127.0.0.1.

    python bench/_range_server.py DIRECTORY --bucket bench --port 4599
"""

from __future__ import annotations

import argparse
import email.utils
import http.server
import os
import socketserver

_CHUNK_BYTES = 1 << 20  # What one sendfile call sends at most.


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # Keep-alive: obstore reuses its connections.
    directory = "."
    bucket = "bench"

    def log_message(self, format, *args) -> None:  # noqa: A002 - the base class's name.
        pass

    def _file(self):
        """(path, size, ETag, Last-Modified) of the object the path names, or None after a 404."""
        bucket, _, key = self.path.split("?", 1)[0].lstrip("/").partition("/")
        path = os.path.join(self.directory, key)
        if bucket != self.bucket or not key or ".." in key.split("/") or not os.path.isfile(path):
            body = b"<Error><Code>NoSuchKey</Code></Error>"
            self.send_response(404)
            self.send_header("Content-Type", "application/xml")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command == "GET":
                self.wfile.write(body)
            return None
        info = os.stat(path)
        etag = f'"{info.st_mtime_ns:x}-{info.st_size:x}"'
        return path, info.st_size, etag, email.utils.formatdate(info.st_mtime, usegmt=True)

    def _answer(self, send_body: bool) -> None:
        found = self._file()
        if found is None:
            return
        path, size, etag, modified = found
        wanted = self.headers.get("If-Match")
        if wanted is not None and wanted.strip() not in (etag, "*"):
            self.send_response(412)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        start, end, status = 0, size, 200
        ranged = self.headers.get("Range")
        if ranged and ranged.startswith("bytes="):
            first, _, last = ranged[6:].partition("-")
            start, end, status = int(first), min(size, int(last) + 1 if last else size), 206
        self.send_response(status)
        self.send_header("Content-Length", str(end - start))
        if status == 206:
            self.send_header("Content-Range", f"bytes {start}-{end - 1}/{size}")
        self.send_header("ETag", etag)
        self.send_header("Last-Modified", modified)
        self.send_header("Accept-Ranges", "bytes")
        self.end_headers()
        if not send_body:
            return
        self.wfile.flush()
        with open(path, "rb") as handle:
            offset = start
            while offset < end:  # Bounded: each call sends at least a byte or raises.
                sent = os.sendfile(self.connection.fileno(), handle.fileno(), offset, min(_CHUNK_BYTES, end - offset))
                if sent == 0:
                    raise ConnectionError(f"{path}: sendfile sent nothing at {offset} of {end}")
                offset += sent

    def do_HEAD(self) -> None:  # noqa: N802 - http.server's name.
        self._answer(False)

    def do_GET(self) -> None:  # noqa: N802 - http.server's name.
        self._answer(True)


class _Server(socketserver.ThreadingMixIn, http.server.HTTPServer):
    daemon_threads = True
    allow_reuse_address = True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("directory")
    parser.add_argument("--bucket", default="bench")
    parser.add_argument("--port", type=int, default=4599)
    args = parser.parse_args()
    _Handler.directory, _Handler.bucket = os.path.abspath(args.directory), args.bucket
    with _Server(("127.0.0.1", args.port), _Handler) as server:
        server.serve_forever()


if __name__ == "__main__":
    main()

"""One home for identity: what a table was built from, and how the package knows it is still so.

* :mod:`~adalncache.identity.files`: a file's ``stat`` identity and the stamp the memo keys on;
* :mod:`~adalncache.identity.digest`: the content digest of the projection tensors (its leaves,
  tensor digests and composition), and the sink a pass hashes into;
* :mod:`~adalncache.identity.memo`: the digest memo, a file stamp's digests in the store and in
  the process;
* :mod:`~adalncache.identity.content`: how a cache learns its source's content digest (the memo,
  a pass, a hashing read) and checks it after every pass;
* :mod:`~adalncache.identity.binding`: what resident tables were built under (fingerprint,
  variant, autocast) and the store binding.

The package itself imports none of them: the source reads file identities and hashes what it
reads (the lower modules) while the binding sits above the source, so each is imported by its
own name and loading one never loads the others.
"""

/* kvbridge._core: the module.  Its parts are in pool.c (threads and the Job handle), copy.c (copy,
 * copy_start, cma_read, cma_start), file.c (file_start), crc32c.c (crc32c) and the tcp lane (tcp.h:
 * TcpServer, TcpSource); core.h says how they fit.  Built with the machine's compiler alone: no UCX, so a
 * host without it still has the fast paths of the cpu, fs, chain and lmcache backends, native checksums
 * and the tcp lane between hosts. */
#include "core.h"

static PyMethodDef module_methods[] = {
    {"copy", (PyCFunction)(void (*)(void))py_copy, METH_VARARGS | METH_KEYWORDS,
     "copy(src, dst, lengths, *, streaming=False) -> bytes copied within this process (GIL released); "
     "streaming: with stores that bypass the cache"},
    {"copy_start", (PyCFunction)(void (*)(void))py_copy_start, METH_VARARGS | METH_KEYWORDS,
     "copy_start(src, dst, lengths, *, streaming=False, cut_bytes=8 MiB, parts=0) -> Copy: copy() on the copy "
     "threads (cut between them from cut_bytes); parts: each run of `parts` pieces checked (Copy.checked())"},
    {"cma_read", (PyCFunction)(void (*)(void))py_cma_read, METH_VARARGS | METH_KEYWORDS,
     "cma_read(pid, remote, local, lengths) -> bytes read from process pid with process_vm_readv (GIL released)"},
    {"cma_start", (PyCFunction)(void (*)(void))py_cma_start, METH_VARARGS | METH_KEYWORDS,
     "cma_start(pid, remote, local, lengths, seal_address=0, *, cut_bytes=8 MiB) -> CmaRead: cma_read on the "
     "copy threads, then the 8-byte word at seal_address"},
    {"drain", kv_drain, METH_O, "drain(timeout_s) -> bool: no transfer queued or running on the copy threads (or the tcp lane's)"},
    {"file_start", (PyCFunction)(void (*)(void))py_file_start, METH_VARARGS | METH_KEYWORDS,
     "file_start(runs, addresses, lengths, parts, *, write=False, cut_bytes, block_ids=None, block_stride=0) -> "
     "FileIO: blocks moved, checked"},
    {"crc32c", (PyCFunction)(void (*)(void))py_crc32c, METH_VARARGS | METH_KEYWORDS,
     "crc32c(addresses, lengths, parts, *, fold=True) -> bytes: crc32c of each run of `parts` pieces, little-endian "
     "uint32s (fold=False: without the carry-less multiplies, where HAS_CRC32C_FOLD)"},
    {NULL}};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "kvbridge._core",
    "kvbridge's native copies, file IO and checksums, without UCX (see kvbridge/csrc/core.h)", -1, module_methods};

PyMODINIT_FUNC PyInit__core(void) {
    PyTypeObject *types[] = {&JobType, &CopyType, &CmaReadType, &FileIOType, &TcpServerType, &TcpSourceType,
                             &TcpReadType};
    const char *names[] = {"Job", "Copy", "CmaRead", "FileIO", "TcpServer", "TcpSource", "TcpRead"};
    const int ntypes = (int)(sizeof(types) / sizeof(types[0]));
    for (int i = 0; i < ntypes; i++)
        if (PyType_Ready(types[i]) < 0) return NULL;
    if (kv_pool_init() < 0) return PyErr_NoMemory();
    crc_init();
    kv_tcp_init();
    PyObject *m = PyModule_Create(&module_def);
    if (!m) return NULL;
    if (PyModule_AddIntConstant(m, "HAS_CRC32C", crc_ready) < 0) goto fail;
    if (PyModule_AddIntConstant(m, "HAS_CRC32C_FOLD", crc_ready && crc_fold) < 0) goto fail;
    if (PyModule_AddIntConstant(m, "IOV_MAX", IOV_MAX) < 0) goto fail;
    for (int i = 0; i < ntypes; i++)
        if (PyModule_AddObjectRef(m, names[i], (PyObject *)types[i]) < 0) goto fail;
    return m;
fail:
    Py_DECREF(m);
    return NULL;
}

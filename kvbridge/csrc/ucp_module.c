/* kvbridge._ucp: the module (ucp.h says how its parts fit). */
#include "ucp.h"

static PyObject *py_version(PyObject *m, PyObject *unused) {
    unsigned major, minor, release;
    ucp_get_version(&major, &minor, &release);
    return Py_BuildValue("(III)", major, minor, release);
}

static PyMethodDef module_methods[] = {
    {"version", py_version, METH_NOARGS, "the loaded libucp's version, (major, minor, release)"},
    {NULL}};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "kvbridge._ucp", "kvbridge's one-sided data plane over ucp (see kvbridge/csrc/ucp.h)",
    -1, module_methods};

PyMODINIT_FUNC PyInit__ucp(void) {
    PyTypeObject *types[] = {&ContextType, &RegionType, &EndpointType};
    const char *names[] = {"Context", "Region", "Endpoint"};
    const int ntypes = (int)(sizeof(types) / sizeof(types[0]));
    for (int i = 0; i < ntypes; i++)
        if (PyType_Ready(types[i]) < 0) return NULL;
    PyObject *m = PyModule_Create(&module_def);
    if (!m) return NULL;
    for (int i = 0; i < ntypes; i++)
        if (PyModule_AddObjectRef(m, names[i], (PyObject *)types[i]) < 0) goto fail;
    PyObject *api = Py_BuildValue("(ii)", UCP_API_MAJOR, UCP_API_MINOR);
    if (PyModule_AddObject(m, "API_VERSION", api) < 0) {
        Py_XDECREF(api);
        goto fail;
    }
    return m;
fail:
    Py_DECREF(m);
    return NULL;
}

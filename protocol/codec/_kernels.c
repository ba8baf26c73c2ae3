/* asyncrl.protocol.codec._kernels: the delta codec's per-element class passes, compiled.
 *
 * numpy has no single-pass stable counting partition, so planes.py builds one out of a uint64
 * cumulative sum (~3 ns per element each way, half of a delta decode: docs/codec.md "Speed"). These
 * two loops do the same work in one pass each (~0.9-1.2 ns per element, against ~2.4-3.1 in numpy).
 * They change no byte of any payload: planes.py calls them when this module is built and falls back to its numpy path when not
 * (`pip install` without a C compiler), and tests/protocol/test_codec_kernels.py holds the two equal.
 *
 *   partition(src, cls, outs) -> None           outs[k] = src's class-k elements, in order (gather)
 *   unpartition(out, cls, streams[, unzigzag]) -> bool
 *                                               out[i] = next unused element of streams[cls[i]]
 *                                               (zigzag-decoded on the way when `unzigzag`: one pass
 *                                               fewer for the delta decoder)
 *
 * Words are unsigned 16- or 32-bit (bf16/fp16 or fp32 bit patterns), classes uint8. Only the buffer
 * protocol is used (no numpy headers at build time). Every size is checked before a byte is read
 * or written (a class array that does not match the class counts: ValueError, or False from
 * unpartition, whose caller treats it as "wrong parent"). The GIL is released around the loops.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

#define MAX_CLASSES 16
#define BLOCK (1 << 20) /* elements per uint32 accumulator: no overflow */

static int get_buffer(PyObject *obj, Py_buffer *view, int writable, const char *what) {
    int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj, view, flags) < 0) {
        return -1;
    }
    if (view->itemsize != 1 && view->itemsize != 2 && view->itemsize != 4) {
        PyErr_Format(PyExc_ValueError, "%s: items of %zd bytes (1, 2 or 4 expected)", what, view->itemsize);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

static Py_ssize_t items(Py_buffer *v) { return v->len / v->itemsize; }

static void release_all(Py_buffer *views, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++) PyBuffer_Release(&views[i]);
}

/* ---- counting ------------------------------------------------------------------------------ */

/* counts[k] = #{i : c[i] == k} for k < nk: one compare-and-add pass per class, which the compiler
 * vectorises (a histogram's h[c[i]]++ is a store-to-load chain through memory, several times slower). */
static void count_classes(const uint8_t *c, Py_ssize_t n, int nk, Py_ssize_t *counts) {
    for (int k = 0; k < nk; k++) {
        Py_ssize_t total = 0;
        for (Py_ssize_t i0 = 0; i0 < n; i0 += BLOCK) {
            Py_ssize_t i1 = i0 + BLOCK < n ? i0 + BLOCK : n;
            uint32_t acc = 0;
            for (Py_ssize_t i = i0; i < i1; i++) acc += c[i] == (uint8_t)k;
            total += acc;
        }
        counts[k] = total;
    }
}

/* ---- partition / unpartition ---------------------------------------------------------------- */

/* Buffers of `seq` (each an array of words of `itemsize`) into views/ptrs/sizes; -1 on error. */
static int class_buffers(PyObject *seq, int writable, Py_ssize_t itemsize, Py_buffer *views, char **ptrs,
                         Py_ssize_t *sizes, Py_ssize_t *nk) {
    PyObject *fast = PySequence_Fast(seq, "expected a sequence of class arrays");
    if (fast == NULL) return -1;
    Py_ssize_t k = PySequence_Fast_GET_SIZE(fast);
    if (k < 1 || k > MAX_CLASSES) {
        Py_DECREF(fast);
        PyErr_Format(PyExc_ValueError, "%zd class arrays (1..%d expected)", k, MAX_CLASSES);
        return -1;
    }
    for (Py_ssize_t i = 0; i < k; i++) {
        if (get_buffer(PySequence_Fast_GET_ITEM(fast, i), &views[i], writable, "class array") < 0) {
            release_all(views, i);
            Py_DECREF(fast);
            return -1;
        }
        if (views[i].itemsize != itemsize) {
            release_all(views, i + 1);
            Py_DECREF(fast);
            PyErr_SetString(PyExc_ValueError, "class arrays must have the words' item size");
            return -1;
        }
        ptrs[i] = (char *)views[i].buf;
        sizes[i] = items(&views[i]);
    }
    Py_DECREF(fast);
    *nk = k;
    return 0;
}

/* Both directions split the n elements into LANES equal runs and walk them side by side, each run
 * with its own per-class cursor (where its class-k members start in class k's array: the class-k
 * counts of the runs before it). The LANES chains are independent, so the CPU overlaps them; one
 * chain alone waits on its cursor's store-to-load forwarding at every element. The cursors come from
 * exact counts, checked against the class arrays' sizes before anything is read or written: no
 * element can land outside its class array, and no bound check runs per element. */
#define LANES 4

/* Cursors (as element offsets into each class array) for the LANES runs; 0 unless the counts fit. */
static int lane_cursors(const uint8_t *cls, Py_ssize_t n, Py_ssize_t nk, const Py_ssize_t *sizes,
                        Py_ssize_t run, Py_ssize_t start[LANES][MAX_CLASSES]) {
    Py_ssize_t seen[MAX_CLASSES] = {0}, total = 0;
    for (int q = 0; q < LANES; q++) {
        Py_ssize_t q0 = q * run, q1 = q == LANES - 1 ? n : q0 + run;  /* the last run takes the remainder */
        Py_ssize_t c[MAX_CLASSES];
        count_classes(cls + q0, q1 - q0, (int)nk, c);
        for (Py_ssize_t k = 0; k < nk; k++) {
            start[q][k] = seen[k];
            seen[k] += c[k];
            total += c[k];
        }
    }
    if (total != n) return 0;  /* an element of a class with no array */
    for (Py_ssize_t k = 0; k < nk; k++)
        if (seen[k] != sizes[k]) return 0;
    return 1;
}

/* MOVE(q, i): element i of run q, between the words array and its class array (GATHER or SCATTER).
 * The loop body below is written out for LANES == 4. */
_Static_assert(LANES == 4, "WALK moves exactly four runs per step");
#define WALK(T, MOVE)                                                               \
    do {                                                                            \
        T *cur[LANES][MAX_CLASSES];                                                 \
        for (int q = 0; q < LANES; q++)                                             \
            for (Py_ssize_t k = 0; k < nk; k++) cur[q][k] = (T *)ptrs[k] + start[q][k]; \
        Py_ssize_t r0 = run, r1 = 2 * run, r2 = 3 * run;                            \
        Py_ssize_t last = n - 3 * run; /* the last run takes the remainder */       \
        for (Py_ssize_t i = 0; i < run; i++) {                                      \
            MOVE(0, i); MOVE(1, r0 + i); MOVE(2, r1 + i); MOVE(3, r2 + i);          \
        }                                                                           \
        for (Py_ssize_t i = run; i < last; i++) MOVE(3, r2 + i);                    \
    } while (0)

#define GATHER_ONE(q, i) (*cur[q][cls[i]]++ = s[i])
#define SCATTER_ONE(q, i) (o[i] = *cur[q][cls[i]]++)
#define UNZIGZAG(v) (((v) >> 1) ^ (0 - ((v) & 1)))
#define SCATTER_UNZIGZAG_ONE(q, i) (v = *cur[q][cls[i]]++, o[i] = UNZIGZAG(v))

/* The buffers of one call: the words (`wv`), their classes (`cv`), the class arrays, and each lane's
 * cursors. open_job checks everything but the counts; `ok` says whether the counts fit too. */
typedef struct {
    Py_buffer wv, cv, views[MAX_CLASSES];
    char *ptrs[MAX_CLASSES];
    Py_ssize_t sizes[MAX_CLASSES], nk, n, run;
    Py_ssize_t start[LANES][MAX_CLASSES];
} Job;

static int open_job(Job *job, PyObject *words, int words_writable, PyObject *cls, PyObject *arrays) {
    if (get_buffer(words, &job->wv, words_writable, "words") < 0) return -1;
    if (get_buffer(cls, &job->cv, 0, "cls") < 0) {
        PyBuffer_Release(&job->wv);
        return -1;
    }
    if (class_buffers(arrays, !words_writable, job->wv.itemsize, job->views, job->ptrs, job->sizes, &job->nk) < 0) {
        PyBuffer_Release(&job->wv);
        PyBuffer_Release(&job->cv);
        return -1;
    }
    job->n = items(&job->wv);
    job->run = job->n / LANES;
    return 0;
}

static int job_fits(Job *job) {  /* word and class sizes, then the counts (no GIL needed) */
    return job->wv.itemsize != 1 && job->cv.itemsize == 1 && items(&job->cv) == job->n &&
           lane_cursors((const uint8_t *)job->cv.buf, job->n, job->nk, job->sizes, job->run, job->start);
}

static void close_job(Job *job) {
    PyBuffer_Release(&job->wv);
    PyBuffer_Release(&job->cv);
    release_all(job->views, job->nk);
}

#define JOB_LOCALS(job)                                                              \
    const uint8_t *cls = (const uint8_t *)(job).cv.buf;                             \
    char **ptrs = (job).ptrs;                                                       \
    Py_ssize_t nk = (job).nk, n = (job).n, run = (job).run;                         \
    Py_ssize_t (*start)[MAX_CLASSES] = (job).start;

static PyObject *partition(PyObject *self, PyObject *args) {
    PyObject *src, *cls_obj, *outs;
    Job job;
    if (!PyArg_ParseTuple(args, "OOO", &src, &cls_obj, &outs)) return NULL;
    if (open_job(&job, src, 0, cls_obj, outs) < 0) return NULL;
    int ok;
    Py_BEGIN_ALLOW_THREADS
    ok = job_fits(&job);
    JOB_LOCALS(job)
    if (ok && job.wv.itemsize == 2) {
        const uint16_t *s = (const uint16_t *)job.wv.buf;
        WALK(uint16_t, GATHER_ONE);
    } else if (ok) {
        const uint32_t *s = (const uint32_t *)job.wv.buf;
        WALK(uint32_t, GATHER_ONE);
    }
    Py_END_ALLOW_THREADS
    close_job(&job);
    if (!ok) {
        PyErr_SetString(PyExc_ValueError, "partition: class arrays do not match the class counts");
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyObject *unpartition(PyObject *self, PyObject *args) {
    PyObject *out, *cls_obj, *streams;
    int unzigzag = 0;
    Job job;
    if (!PyArg_ParseTuple(args, "OOO|p", &out, &cls_obj, &streams, &unzigzag)) return NULL;
    if (open_job(&job, out, 1, cls_obj, streams) < 0) return NULL;
    int ok;
    Py_BEGIN_ALLOW_THREADS
    ok = job_fits(&job);
    JOB_LOCALS(job)
    if (ok && job.wv.itemsize == 2) {
        uint16_t *o = (uint16_t *)job.wv.buf, v;
        if (unzigzag) WALK(uint16_t, SCATTER_UNZIGZAG_ONE);
        else WALK(uint16_t, SCATTER_ONE);
    } else if (ok) {
        uint32_t *o = (uint32_t *)job.wv.buf, v;
        if (unzigzag) WALK(uint32_t, SCATTER_UNZIGZAG_ONE);
        else WALK(uint32_t, SCATTER_ONE);
    }
    Py_END_ALLOW_THREADS
    close_job(&job);
    return PyBool_FromLong(ok);
}

static PyMethodDef methods[] = {
    {"partition", partition, METH_VARARGS, "partition(src, cls, outs): stable gather of src by class"},
    {"unpartition", unpartition, METH_VARARGS,
     "unpartition(out, cls, streams, unzigzag=False) -> bool: inverse of partition"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_kernels", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__kernels(void) { return PyModule_Create(&module); }

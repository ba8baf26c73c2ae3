/* asyncrl.protocol.codec._kernels: the delta codec's per-element class passes, compiled.
 *
 * numpy has no single-pass stable counting partition, so planes.py builds one out of a uint64
 * cumulative sum (~3 ns per element each way, half of a delta decode: docs/codec.md "Speed"). These
 * two loops do the same work in one pass each (~0.9-1.2 ns per element, against ~2.4-3.1 in numpy).
 * The decoder's other per-element passes are here too (2026-12-03): a delta decode is memory-bound on
 * this class of machine, so what costs is how many times the words cross memory, and numpy's
 * plane unpacking makes ~12 passes and its class computation 2 per bound where these make one.
 * They change no byte of any payload: planes.py calls them when this module is built and falls back to its numpy path when not
 * (`pip install` without a C compiler), and tests/protocol/test_codec_kernels.py holds the two equal.
 *
 *   partition(src, cls, outs) -> None           outs[k] = src's class-k elements, in order (gather)
 *   unpartition(out, cls, streams[, unzigzag]) -> bool
 *                                               out[i] = next unused element of streams[cls[i]]
 *                                               (zigzag-decoded on the way when `unzigzag`: one pass
 *                                               fewer for the delta decoder)
 *   classes(out, parents, limits) -> None       out = each element of the concatenated parents' class:
 *                                               how many `limits` its magnitude bits reach (one pass,
 *                                               where numpy makes one per bound and a masked copy)
 *   unpack(out, fields, planes[, unzigzag]) -> None
 *                                               out[i] = the word whose planes are `planes` (byte
 *                                               planes, or with `fields` the 1-1-2-4 bit fields of the
 *                                               low byte then the upper byte planes: planes.py
 *                                               iter_planes), zigzag-decoded when asked: one pass where
 *                                               numpy makes ~12
 *
 * Words are unsigned 16- or 32-bit (bf16/fp16 or fp32 bit patterns), classes uint8. Only the buffer
 * protocol is used (no numpy headers at build time). Every size is checked before a byte is read
 * or written (a class array that does not match the class counts: ValueError, or False from
 * unpartition, whose caller treats it as "wrong parent"). The GIL is released around the loops.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

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

/* counts[k] = #{i : c[i] == k} for k < nk, in ONE pass over c (the words are memory-bound: a pass per
 * class read c nk times). Each class has its own accumulator and the class count is a constant in each
 * expansion, so the compare-and-adds vectorise (a histogram's h[c[i]]++ is a store-to-load chain through
 * memory, several times slower). */
#define COUNT_NK(NK)                                                                 \
    do {                                                                            \
        for (Py_ssize_t i0 = 0; i0 < n; i0 += BLOCK) {                              \
            Py_ssize_t i1 = i0 + BLOCK < n ? i0 + BLOCK : n;                        \
            uint32_t acc[(NK)] = {0};                                               \
            for (Py_ssize_t i = i0; i < i1; i++)                                    \
                for (int k = 0; k < (NK); k++) acc[k] += c[i] == (uint8_t)k;        \
            for (int k = 0; k < (NK); k++) counts[k] += acc[k];                     \
        }                                                                           \
    } while (0)

static void count_classes(const uint8_t *c, Py_ssize_t n, int nk, Py_ssize_t *counts) {
    for (int k = 0; k < nk; k++) counts[k] = 0;
    switch (nk) {
        case 1: counts[0] = n; return;
        case 2: COUNT_NK(2); return;
        case 3: COUNT_NK(3); return;
        case 4: COUNT_NK(4); return;
    }
    for (int k = 0; k < nk; k++) {  /* more classes than the encoder makes: a pass per class */
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

/* ---- classes: each parent element's exponent class ------------------------------------------- */

/* NB is a constant in each expansion (the encoder uses up to 4 classes, so 3 bounds): the compare-and-add
 * chain unrolls and the loop vectorises; with a run-time bound count it does not (10x slower than numpy). */
#define CLASS_LOOP_NB(T, NB)                                                         \
    do {                                                                            \
        for (Py_ssize_t i = 0; i < len; i++) {                                      \
            T m = w[i] & mag;                                                       \
            uint8_t c = 0;                                                          \
            for (int b = 0; b < (NB); b++) c += m >= lim[b];                        \
            o[i] = c;                                                               \
        }                                                                           \
    } while (0)
#define CLASS_LOOP(T)                                                                \
    do {                                                                            \
        const T *w = (const T *)views[t].buf;                                        \
        const T mag = (T)~((T)1 << (8 * sizeof(T) - 1));                             \
        T lim[MAX_CLASSES];                                                         \
        for (Py_ssize_t b = 0; b < nb; b++) lim[b] = (T)limits[b];                  \
        switch (nb) {                                                               \
            case 0: memset(o, 0, (size_t)len); break;                               \
            case 1: CLASS_LOOP_NB(T, 1); break;                                     \
            case 2: CLASS_LOOP_NB(T, 2); break;                                     \
            case 3: CLASS_LOOP_NB(T, 3); break;                                     \
            default: CLASS_LOOP_NB(T, nb); break;                                   \
        }                                                                           \
    } while (0)

static PyObject *classes(PyObject *self, PyObject *args) {
    PyObject *out, *parents, *limits_obj;
    Py_buffer ov, *views;
    unsigned long long limits[MAX_CLASSES];
    if (!PyArg_ParseTuple(args, "OOO", &out, &parents, &limits_obj)) return NULL;
    PyObject *lf = PySequence_Fast(limits_obj, "limits: expected a sequence of ints");
    if (lf == NULL) return NULL;
    Py_ssize_t nb = PySequence_Fast_GET_SIZE(lf);
    if (nb >= MAX_CLASSES) {
        Py_DECREF(lf);
        PyErr_Format(PyExc_ValueError, "%zd limits (at most %d)", nb, MAX_CLASSES - 1);
        return NULL;
    }
    for (Py_ssize_t b = 0; b < nb; b++) {
        limits[b] = PyLong_AsUnsignedLongLong(PySequence_Fast_GET_ITEM(lf, b));
        if (PyErr_Occurred()) {
            Py_DECREF(lf);
            return NULL;
        }
    }
    Py_DECREF(lf);
    PyObject *pf = PySequence_Fast(parents, "parents: expected a sequence of word arrays");
    if (pf == NULL) return NULL;
    Py_ssize_t np_ = PySequence_Fast_GET_SIZE(pf), total = 0, itemsize = 0, t = 0;
    views = PyMem_New(Py_buffer, np_ ? np_ : 1);
    if (views == NULL) {
        Py_DECREF(pf);
        return PyErr_NoMemory();
    }
    for (; t < np_; t++) {
        if (get_buffer(PySequence_Fast_GET_ITEM(pf, t), &views[t], 0, "parent") < 0) break;
        if (views[t].itemsize == 1 || (itemsize && views[t].itemsize != itemsize)) {
            PyBuffer_Release(&views[t]);
            PyErr_SetString(PyExc_ValueError, "parents: words of one size, 2 or 4 bytes");
            break;
        }
        itemsize = views[t].itemsize;
        total += items(&views[t]);
    }
    Py_DECREF(pf);
    if (t < np_) {
        release_all(views, t);
        PyMem_Free(views);
        return NULL;
    }
    if (get_buffer(out, &ov, 1, "out") < 0) {
        release_all(views, np_);
        PyMem_Free(views);
        return NULL;
    }
    if (ov.itemsize != 1 || ov.len != total) {
        PyBuffer_Release(&ov);
        release_all(views, np_);
        PyMem_Free(views);
        PyErr_SetString(PyExc_ValueError, "out: one byte per parent element expected");
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    uint8_t *o = (uint8_t *)ov.buf;
    for (t = 0; t < np_; t++) {
        Py_ssize_t len = items(&views[t]);
        if (itemsize == 2) CLASS_LOOP(uint16_t);
        else CLASS_LOOP(uint32_t);
        o += len;
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&ov);
    release_all(views, np_);
    PyMem_Free(views);
    Py_RETURN_NONE;
}

/* ---- unpack: planes back into words ---------------------------------------------------------- */

/* The planes' buffers, each checked to hold exactly what `n` words need (planes.py plane_sizes). */
static int plane_buffers(PyObject *seq, int fields, Py_ssize_t itemsize, Py_ssize_t n, Py_buffer *views,
                         const uint8_t **ptrs) {
    PyObject *fast = PySequence_Fast(seq, "expected a sequence of planes");
    if (fast == NULL) return -1;
    Py_ssize_t want = fields ? 4 + itemsize - 1 : itemsize, k = PySequence_Fast_GET_SIZE(fast);
    if (k != want) {
        Py_DECREF(fast);
        PyErr_Format(PyExc_ValueError, "%zd planes (%zd expected)", k, want);
        return -1;
    }
    for (Py_ssize_t j = 0; j < k; j++) {
        Py_ssize_t len = n;
        if (fields && j < 2) len = (n + 7) / 8;
        else if (fields && j == 2) len = (n + 3) / 4;
        else if (fields && j == 3) len = (n + 1) / 2;
        if (get_buffer(PySequence_Fast_GET_ITEM(fast, j), &views[j], 0, "plane") < 0) {
            release_all(views, j);
            Py_DECREF(fast);
            return -1;
        }
        if (views[j].len != len) {
            release_all(views, j + 1);
            Py_DECREF(fast);
            PyErr_Format(PyExc_ValueError, "plane %zd holds %zd bytes (%zd expected)", j, views[j].len, len);
            return -1;
        }
        ptrs[j] = (const uint8_t *)views[j].buf;
    }
    Py_DECREF(fast);
    return 0;
}

/* Low byte of word i from the four bit-field planes (bits 0, 1, 2-3, 4-7). */
static inline uint32_t field_byte(const uint8_t *const *p, Py_ssize_t i) {
    return ((p[0][i >> 3] >> (i & 7)) & 1u) | (((p[1][i >> 3] >> (i & 7)) & 1u) << 1) |
           (((p[2][i >> 2] >> (2 * (i & 3))) & 3u) << 2) | (((p[3][i >> 1] >> (4 * (i & 1))) & 15u) << 4);
}

/* Bit fields, eight words at a time: tables spread one plane byte over the low bytes of the words
 * it covers (8 one-bit fields, 4 two-bit fields or 2 four-bit fields), so a block's eight low bytes are
 * four ORs of table entries in one uint64 (byte j = word j's low byte). Built once, at import. */
static uint64_t SPREAD1[256];
static uint32_t SPREAD2[256];
static uint16_t SPREAD4[256];

static void build_tables(void) {
    for (unsigned b = 0; b < 256; b++) {
        uint64_t s1 = 0;
        uint32_t s2 = 0;
        for (int j = 0; j < 8; j++) s1 |= (uint64_t)((b >> j) & 1u) << (8 * j);
        for (int j = 0; j < 4; j++) s2 |= (uint32_t)((b >> (2 * j)) & 3u) << (8 * j);
        SPREAD1[b] = s1;
        SPREAD2[b] = s2;
        SPREAD4[b] = (uint16_t)((b & 15u) | ((b >> 4) << 8));
    }
}

static inline uint64_t field_block(const uint8_t *const *p, Py_ssize_t k) {  /* words 8k .. 8k+7 */
    const uint8_t *f2 = p[2] + 2 * k, *f4 = p[3] + 4 * k;
    uint64_t two = (uint64_t)SPREAD2[f2[0]] | (uint64_t)SPREAD2[f2[1]] << 32;
    uint64_t four = (uint64_t)SPREAD4[f4[0]] | (uint64_t)SPREAD4[f4[1]] << 16 | (uint64_t)SPREAD4[f4[2]] << 32 |
                    (uint64_t)SPREAD4[f4[3]] << 48;
    return SPREAD1[p[0][k]] | SPREAD1[p[1][k]] << 1 | two << 2 | four << 4;
}

/* One loop per (word type, layout, unzigzag): FIELDS and ZZ are constants in each expansion. */
#define WORD(T, NUP, LOW, i) (T)((T)(LOW) | ((NUP) >= 1 ? (T)((T)up[0][i] << 8) : 0) |                   \
                                 ((NUP) >= 3 ? (T)((T)up[1][i] << 16 | (T)up[2][i] << 24) : 0))
#define PUT(T, ZZ, i, v) (o[i] = (ZZ) ? (T)UNZIGZAG(v) : (v))
#define UNPACK_LOOP(T, NUP, FIELDS, ZZ)                                              \
    do {                                                                            \
        T *o = (T *)ov.buf;                                                         \
        const uint8_t *const *up = ptrs + ((FIELDS) ? 4 : 1);                       \
        Py_ssize_t i = 0;                                                           \
        if (FIELDS) {                                                               \
            for (Py_ssize_t k = 0; k < n / 8; k++) {                                \
                uint64_t lo = field_block(ptrs, k);                                 \
                for (int j = 0; j < 8; j++, i++) {                                  \
                    T v = WORD(T, NUP, (lo >> (8 * j)) & 0xFFu, i);                 \
                    PUT(T, ZZ, i, v);                                               \
                }                                                                   \
            }                                                                       \
        }                                                                           \
        for (; i < n; i++) {                                                        \
            T v = WORD(T, NUP, (FIELDS) ? field_byte(ptrs, i) : ptrs[0][i], i);     \
            PUT(T, ZZ, i, v);                                                       \
        }                                                                           \
    } while (0)
#define UNPACK_ALL(T, NUP)                                                           \
    do {                                                                            \
        if (fields && unzigzag) UNPACK_LOOP(T, NUP, 1, 1);                          \
        else if (fields) UNPACK_LOOP(T, NUP, 1, 0);                                 \
        else if (unzigzag) UNPACK_LOOP(T, NUP, 0, 1);                               \
        else UNPACK_LOOP(T, NUP, 0, 0);                                             \
    } while (0)

static PyObject *unpack(PyObject *self, PyObject *args) {
    PyObject *out, *planes;
    int fields, unzigzag = 0;
    Py_buffer ov, views[4 + 3];
    const uint8_t *ptrs[4 + 3];
    if (!PyArg_ParseTuple(args, "OpO|p", &out, &fields, &planes, &unzigzag)) return NULL;
    if (get_buffer(out, &ov, 1, "out") < 0) return NULL;
    if (ov.itemsize == 1) {
        PyBuffer_Release(&ov);
        PyErr_SetString(PyExc_ValueError, "out: words of 2 or 4 bytes expected");
        return NULL;
    }
    Py_ssize_t n = items(&ov), itemsize = ov.itemsize;
    if (plane_buffers(planes, fields, itemsize, n, views, ptrs) < 0) {
        PyBuffer_Release(&ov);
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    if (itemsize == 2) UNPACK_ALL(uint16_t, 1);
    else UNPACK_ALL(uint32_t, 3);
    Py_END_ALLOW_THREADS
    release_all(views, fields ? 4 + itemsize - 1 : itemsize);
    PyBuffer_Release(&ov);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"partition", partition, METH_VARARGS, "partition(src, cls, outs): stable gather of src by class"},
    {"unpartition", unpartition, METH_VARARGS,
     "unpartition(out, cls, streams, unzigzag=False) -> bool: inverse of partition"},
    {"classes", classes, METH_VARARGS, "classes(out, parents, limits): exponent class of each parent element"},
    {"unpack", unpack, METH_VARARGS,
     "unpack(out, fields, planes, unzigzag=False): words from their byte planes or bit fields"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_kernels", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__kernels(void) {
    build_tables();
    return PyModule_Create(&module);
}

/*
 * A dataset sample's global generator states (shmloader/fill/global_seeds.py): before each
 * __getitem__ a reader sets Python's `random`, numpy's legacy `np.random` and torch's CPU
 * generator, three Mersenne Twisters (MT19937), to states that are a function of the
 * sample's seed. It lives in this extension, not in the Zig library, for two reasons: a
 * call here is a CPython vectorcall (tens of nanoseconds) where a cffi call with its nine
 * pointer arguments cost about 0.5 us, a quarter of a small sample's seeding; and a C
 * compiler can build one function for several instruction sets (target attributes) and
 * pick one at run time, where the Zig library is built for one baseline CPU.
 *
 * The state of (seed, domain): splitmix64's sequence from mix64(seed ^ domain), word 2j
 * the low half of its j-th output (j from 1) and word 2j + 1 the high half; word 0 then
 * 0x80000000, as CPython's init_by_array leaves it (only its top bit counts in MT, and the
 * all-zero state is one MT never leaves). Each output is independent of the others, unlike
 * MT's own seeding (init_by_array: 1,900 steps each waiting on the one before), so the words
 * vectorise: eight 64-bit lanes with AVX-512DQ's 64-bit multiply, four with AVX2. Every
 * instruction set gives the same words (tests/test_global_seeds.py checks each the CPU has
 * against global_seeds.mt19937_words, numpy's rebuild). The domains keep the generators
 * apart: one word sequence in two of them would make random.random() equal
 * np.random.random_sample().
 *
 * Nothing here finds a generator's memory: global_seeds.py finds each address once per
 * process through the generators' public getstate/get_state and checks it by writing a
 * probe generator through it and reading the probe back, before any address comes here.
 */
#include "_cursor.h"

#define MT_WORDS 624
#define GOLDEN 0x9E3779B97F4A7C15ULL

static const uint64_t domains[3] = {
    0x707974686F6E0001ULL, /* "python" + 1: random */
    0x6E756D7079000002ULL, /* "numpy" + 2: np.random */
    0x746F726368000003ULL, /* "torch" + 3: torch's CPU generator */
};

static inline uint64_t mix64(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}

/* One body, compiled three times: the compiler vectorises the loop for each target. The
 * pairs of words are written as one 64-bit store (a little-endian host's order; a
 * big-endian one swaps the halves below). */
#define FILL_BODY                                                                          \
    uint64_t base = mix64(seed ^ domain);                                                  \
    for (int j = 0; j < MT_WORDS / 2; j++) {                                               \
        uint64_t z = mix64(base + (uint64_t)(j + 1) * GOLDEN);                             \
        memcpy(out + 2 * j, &z, sizeof z);                                                 \
    }

static void fill_portable(uint64_t seed, uint64_t domain, uint32_t *out) { FILL_BODY }

#if defined(__x86_64__)
__attribute__((target("avx2"))) static void fill_avx2(uint64_t seed, uint64_t domain, uint32_t *out) {
    FILL_BODY
}

__attribute__((target("avx512f,avx512dq"))) static void fill_avx512(uint64_t seed, uint64_t domain,
                                                                    uint32_t *out) {
    FILL_BODY
}

/* The widest loop the CPU and the OS (its saved register state, XCR0) allow. */
static int cpu_width(void) {
    unsigned int eax, ebx, ecx, edx;
    __asm__ volatile("cpuid" : "=a"(eax), "=b"(ebx), "=c"(ecx), "=d"(edx) : "a"(0), "c"(0));
    if (eax < 7) {
        return 1;
    }
    __asm__ volatile("cpuid" : "=a"(eax), "=b"(ebx), "=c"(ecx), "=d"(edx) : "a"(1), "c"(0));
    if (!(ecx & (1u << 27)) || !(ecx & (1u << 28))) { /* OSXSAVE and AVX */
        return 1;
    }
    unsigned int xcr0_low, xcr0_high;
    __asm__ volatile("xgetbv" : "=a"(xcr0_low), "=d"(xcr0_high) : "c"(0));
    __asm__ volatile("cpuid" : "=a"(eax), "=b"(ebx), "=c"(ecx), "=d"(edx) : "a"(7), "c"(0));
    int avx2 = (ebx & (1u << 5)) && (xcr0_low & 0x6) == 0x6;
    int avx512 = avx2 && (ebx & (1u << 16)) && (ebx & (1u << 17)) && (xcr0_low & 0xE6) == 0xE6; /* F, DQ */
    return avx512 ? 3 : avx2 ? 2 : 1;
}
#else
static int cpu_width(void) { return 1; }
#endif

typedef void (*fill_fn)(uint64_t, uint64_t, uint32_t *);

/* The loop for `width` (1 portable, 2 AVX2, 3 AVX-512; 0 the widest the CPU has), or NULL
 * where the CPU lacks it. */
static fill_fn fill_for(int width) {
    static int widest = 0;
    if (widest == 0) {
        widest = cpu_width();
    }
    if (width == 0) {
        width = widest;
    }
    if (width < 1 || width > widest) {
        return NULL;
    }
#if defined(__x86_64__)
    if (width == 3) {
        return fill_avx512;
    }
    if (width == 2) {
        return fill_avx2;
    }
#endif
    return fill_portable;
}

static void fill_state(fill_fn fill, uint64_t seed, int domain, uint32_t *out) {
    fill(seed, domains[domain], out);
#if __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    for (int j = 0; j < MT_WORDS; j += 2) { /* The low half first, as on a little-endian host. */
        uint32_t high = out[j];
        out[j] = out[j + 1];
        out[j + 1] = high;
    }
#endif
    out[0] = 0x80000000u;
}

/* Where each generator's state is: 0 for one not set. */
typedef struct {
    uintptr_t python_index;    /* int: random's position (624: the next draw twists first) */
    uintptr_t python_state;    /* uint32_t[624]: its key */
    uintptr_t numpy_pos;       /* int: np.random's MT19937 position */
    uintptr_t numpy_state;     /* uint32_t[624]: its key */
    uintptr_t numpy_has_gauss; /* int: its RandomState's cached Box-Muller normal, cleared */
    uintptr_t numpy_gauss;     /* double: that normal */
    uintptr_t torch_engine;    /* torch's CPUGeneratorImpl's engine_ (TORCH_* below) */
} Addresses;

#define ADDRESS_COUNT 7

/* Torch's CPU generator as libtorch lays it out (CPUGeneratorImpl: an at::mt19937 engine_,
 * whose mt19937_data_pod is seed_ (uint64), left_ (int), seeded_ (bool), next_ (uint32),
 * state_ (624 uint32), padded to 8 bytes; then std::optional<float> and
 * std::optional<double>, the cached normals, each its value and then its flag). global_seeds.py finds engine_ and checks every one of these offsets on a probe
 * generator (each cached normal set, then written through here and read back through
 * get_state) before it gives an address; the write leaves what set_state of a freshly
 * seeded state leaves: the key, the seed, left_ 1, seeded_, next_ 0, no cached normal. */
#define TORCH_LEFT 8
#define TORCH_SEEDED 12
#define TORCH_NEXT 16
#define TORCH_STATE 20
#define TORCH_FLOAT_ENGAGED (TORCH_STATE + 4 * MT_WORDS + 8)
#define TORCH_DOUBLE_ENGAGED (TORCH_STATE + 4 * MT_WORDS + 20)

static void write_states(fill_fn fill, uint64_t seed, const Addresses *at) {
    if (at->python_index && at->python_state) {
        fill_state(fill, seed, 0, (uint32_t *)at->python_state);
        *(int *)at->python_index = MT_WORDS;
    }
    if (at->numpy_pos && at->numpy_state) {
        fill_state(fill, seed, 1, (uint32_t *)at->numpy_state);
        *(int *)at->numpy_pos = MT_WORDS;
    }
    if (at->numpy_has_gauss) {
        *(int *)at->numpy_has_gauss = 0;
    }
    if (at->numpy_gauss) {
        *(double *)at->numpy_gauss = 0.0;
    }
    if (at->torch_engine) {
        unsigned char *engine = (unsigned char *)at->torch_engine;
        uint64_t initial = seed & INT64_MAX; /* as torch.manual_seed(seed & (2^63 - 1)) leaves it */
        int left = 1;
        uint32_t next = 0;
        fill_state(fill, seed, 2, (uint32_t *)(engine + TORCH_STATE));
        memcpy(engine, &initial, sizeof initial);
        memcpy(engine + TORCH_LEFT, &left, sizeof left);
        engine[TORCH_SEEDED] = 1;
        memcpy(engine + TORCH_NEXT, &next, sizeof next);
        engine[TORCH_FLOAT_ENGAGED] = 0;
        engine[TORCH_DOUBLE_ENGAGED] = 0;
    }
}

/* A tuple of ADDRESS_COUNT integers (0: none) into `at`; -1 with an exception if not. */
static int parse_addresses(PyObject *tuple, Addresses *at) {
    if (!PyTuple_Check(tuple) || PyTuple_GET_SIZE(tuple) != ADDRESS_COUNT) {
        PyErr_Format(PyExc_TypeError, "addresses: expected a tuple of %d integers (0 for none)", ADDRESS_COUNT);
        return -1;
    }
    uintptr_t *fields = (uintptr_t *)at;
    for (int i = 0; i < ADDRESS_COUNT; i++) {
        fields[i] = (uintptr_t)PyLong_AsVoidPtr(PyTuple_GET_ITEM(tuple, i));
        if (fields[i] == 0 && PyErr_Occurred()) {
            return -1;
        }
    }
    return 0;
}

static int seed_of(PyObject *value, uint64_t *seed) {
    if (!PyLong_Check(value)) {
        PyErr_Format(PyExc_TypeError, "a sample's seed is an int, not %.100s", Py_TYPE(value)->tp_name);
        return -1;
    }
    *seed = PyLong_AsUnsignedLongLongMask(value); /* its low 64 bits, as `value & (2**64 - 1)` */
    return *seed == (uint64_t)-1 && PyErr_Occurred() ? -1 : 0;
}

/* write_generator_states(seed, addresses): the states of `seed` written at `addresses`
 * (global_seeds.py's probes, and its seed_all). */
PyObject *seeds_write(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    Addresses at;
    uint64_t seed;
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "write_generator_states(seed, addresses) takes 2 arguments");
        return NULL;
    }
    if (seed_of(args[0], &seed) < 0 || parse_addresses(args[1], &at) < 0) {
        return NULL;
    }
    write_states(fill_for(0), seed, &at);
    Py_RETURN_NONE;
}

/* generator_words(seed, domain, width=0): the 624 words of (seed, domain index 0-2) as
 * bytes, by the loop of `width` (1 portable, 2 AVX2, 3 AVX-512, 0 the widest the CPU has);
 * ValueError where the CPU lacks it. For tests: every loop gives the same words. */
PyObject *seeds_words(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    uint64_t seed;
    if (nargs < 2 || nargs > 3) {
        PyErr_SetString(PyExc_TypeError, "generator_words(seed, domain, width=0) takes 2 or 3 arguments");
        return NULL;
    }
    if (seed_of(args[0], &seed) < 0) {
        return NULL;
    }
    long domain = PyLong_AsLong(args[1]), width = nargs == 3 ? PyLong_AsLong(args[2]) : 0;
    if (PyErr_Occurred()) {
        return NULL;
    }
    if (domain < 0 || domain > 2) {
        PyErr_Format(PyExc_ValueError, "domain: expected 0 (random), 1 (numpy) or 2 (torch), not %ld", domain);
        return NULL;
    }
    fill_fn fill = fill_for((int)width);
    if (fill == NULL) {
        PyErr_Format(PyExc_ValueError, "width %ld: this CPU's widest loop is %d (1 portable, 2 AVX2, 3 AVX-512)",
                     width, cpu_width());
        return NULL;
    }
    uint32_t words[MT_WORDS];
    fill_state(fill, seed, (int)domain, words);
    return PyBytes_FromStringAndSize((const char *)words, sizeof words);
}

/* ---- SampleSeeder --------------------------------------------------------------------- */

/* seeder(seed): a sample's three states written, with what the generators keep beside them
 * reset as their own seeding resets it, in one call a sample and no Python frame. Built for
 * one batch by global_seeds.sample_seeder(), which found the addresses; where what they
 * were found for has changed (np.random.set_bit_generator replaced numpy's bit generator,
 * or torch was imported since), it calls `fallback(seed)` instead (global_seeds.seed_all). */
typedef struct {
    PyObject_HEAD
    Addresses at;
    fill_fn fill;
    PyObject *random_instance; /* random._inst: its gauss_next is cleared, as Random.seed does */
    PyObject *legacy;          /* np.random.mtrand._rand */
    PyObject *bit_generator;   /* the bit generator whose state `at` points into */
    PyObject *modules;         /* sys.modules: torch imported since? */
    PyObject *fallback;
    vectorcallfunc vectorcall;
} SampleSeeder;

static PyObject *gauss_next_name, *bit_generator_name, *torch_name;

static PyObject *seeder_call(SampleSeeder *self, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    uint64_t seed;
    if (PyVectorcall_NARGS(nargsf) != 1 || kwnames != NULL) {
        PyErr_SetString(PyExc_TypeError, "a sample seeder takes the sample's seed");
        return NULL;
    }
    if (seed_of(args[0], &seed) < 0) {
        return NULL;
    }
    PyObject *current = PyObject_GetAttr(self->legacy, bit_generator_name);
    if (current == NULL) {
        return NULL;
    }
    Py_DECREF(current); /* Only its identity is compared. */
    int torch_since = !self->at.torch_engine && PyDict_GetItemWithError(self->modules, torch_name) != NULL;
    if (PyErr_Occurred()) {
        return NULL;
    }
    if (current != self->bit_generator || torch_since) {
        return PyObject_CallOneArg(self->fallback, args[0]);
    }
    write_states(self->fill, seed, &self->at);
    if (PyObject_SetAttr(self->random_instance, gauss_next_name, Py_None) < 0) {
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyObject *seeder_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    PyObject *addresses, *random_instance, *legacy, *bit_generator, *modules, *fallback;
    static char *names[] = {"addresses", "random_instance", "legacy", "bit_generator", "modules", "fallback", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOOOO!O:SampleSeeder", names, &addresses, &random_instance,
                                     &legacy, &bit_generator, &PyDict_Type, &modules, &fallback)) {
        return NULL;
    }
    if (!PyCallable_Check(fallback)) {
        PyErr_SetString(PyExc_TypeError, "SampleSeeder: fallback must be callable");
        return NULL;
    }
    SampleSeeder *self = (SampleSeeder *)type->tp_alloc(type, 0);
    if (self == NULL) {
        return NULL;
    }
    if (parse_addresses(addresses, &self->at) < 0) {
        Py_DECREF(self);
        return NULL;
    }
    self->fill = fill_for(0);
    self->random_instance = Py_NewRef(random_instance);
    self->legacy = Py_NewRef(legacy);
    self->bit_generator = Py_NewRef(bit_generator);
    self->modules = Py_NewRef(modules);
    self->fallback = Py_NewRef(fallback);
    self->vectorcall = (vectorcallfunc)seeder_call;
    return (PyObject *)self;
}

static int seeder_traverse(SampleSeeder *self, visitproc visit, void *arg) {
    Py_VISIT(self->random_instance);
    Py_VISIT(self->legacy);
    Py_VISIT(self->bit_generator);
    Py_VISIT(self->modules);
    Py_VISIT(self->fallback);
    return 0;
}

static int seeder_clear(SampleSeeder *self) {
    Py_CLEAR(self->random_instance);
    Py_CLEAR(self->legacy);
    Py_CLEAR(self->bit_generator);
    Py_CLEAR(self->modules);
    Py_CLEAR(self->fallback);
    return 0;
}

static void seeder_dealloc(SampleSeeder *self) {
    PyObject_GC_UnTrack(self);
    seeder_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

PyTypeObject SampleSeederType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "shmloader.ring._cursor.SampleSeeder",
    .tp_doc = "SampleSeeder(addresses, random_instance, legacy, bit_generator, modules, fallback): seeder(seed) sets a sample's global generator states (fill/global_seeds.py).",
    .tp_basicsize = sizeof(SampleSeeder),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_new = seeder_new,
    .tp_dealloc = (destructor)seeder_dealloc,
    .tp_traverse = (traverseproc)seeder_traverse,
    .tp_clear = (inquiry)seeder_clear,
    .tp_call = PyVectorcall_Call,
    .tp_vectorcall_offset = offsetof(SampleSeeder, vectorcall),
};

/* The names the seeder looks up, made once (PyInit__cursor); -1 with an exception if not. */
int seeds_ready(void) {
    gauss_next_name = PyUnicode_InternFromString("gauss_next");
    bit_generator_name = PyUnicode_InternFromString("_bit_generator");
    torch_name = PyUnicode_InternFromString("torch");
    if (gauss_next_name == NULL || bit_generator_name == NULL || torch_name == NULL) {
        return -1;
    }
    return PyType_Ready(&SampleSeederType);
}
